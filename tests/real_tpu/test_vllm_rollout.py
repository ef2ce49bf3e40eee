"""tpuray.rl.RolloutEngine over vLLM-TorchTPU on the real chip, in this process (its engine core and
worker here: VLLM_ENABLE_V1_MULTIPROCESSING=0). Two small models trained here with different seeds, a and
b (taught different texts): the engine starts with a's weights and gives the embedded engine's greedy
tokens for a on the chip;
`update_weights(b's state dict)` (handed to vLLM's worker without a copy, loaded by vLLM's layer-wise
reload) gives b's; a misshapen update is refused and changes nothing; `sleep()` raises
SleepModeUnavailable naming the platform, as vLLM refuses its sleep mode on it."""

from __future__ import annotations

import gc
import os

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (vLLM-TorchTPU) is not installed")
PROMPT = "Ray schedules tasks and actors"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """a and b learn texts that continue PROMPT differently (trained on the same text, two seeds learn the
    same continuation: their greedy tokens were equal on the chip), each confidently."""
    from tpuray.models import DEFAULT_CORPUS, train_tiny_causal_lm

    root = tmp_path_factory.mktemp("vllm-rollout")
    corpus_b = DEFAULT_CORPUS.replace(f"{PROMPT} across a cluster.", f"{PROMPT} on every host of a slice.")
    assert corpus_b != DEFAULT_CORPUS
    return [
        str(train_tiny_causal_lm(root / "a", steps=300, seed=0)),
        str(train_tiny_causal_lm(root / "b", corpus_b, steps=300, seed=1)),
    ]


def test_updates_and_sleep_through_vllm_on_the_chip(tpu, models, embedded_greedy):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuray.rl import RolloutConfig, WeightMismatchError, rollout_engine
    from tpuray.rl.rollout.vllm import SleepModeUnavailable
    from tpuray.serve.llm.generation import SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    a, b = models
    prompt_a, prompt_b = (
        AutoTokenizer.from_pretrained(m).encode(PROMPT, add_special_tokens=False) for m in models
    )
    want_a, want_b = (
        embedded_greedy(m, p, 32, device="tpu", dtype="bfloat16")
        for m, p in zip(models, (prompt_a, prompt_b), strict=True)
    )  # before vLLM takes its part of the chip
    assert want_a != want_b
    gc.collect()
    if hasattr(torch.accelerator, "empty_cache"):
        torch.accelerator.empty_cache()
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    # "auto" picks the embedded engine on this platform (it sleeps; vLLM's sleep mode is refused here)
    assert RolloutConfig(a, max_model_len=256, max_num_seqs=4, dtype="bfloat16").resolved_engine == "embedded"
    config = RolloutConfig(a, engine="vllm", max_model_len=256, max_num_seqs=4, dtype="bfloat16")
    # this test process holds other tests' leftovers: vLLM takes half the chip's memory, not its default
    config.llm_config.engine_kwargs["gpu_memory_utilization"] = 0.5
    with rollout_engine(config) as engine:
        info = engine.describe()
        print("describe:", {k: info[k] for k in ("platform", "where", "in_process", "sleep_mode")})
        assert info["platform"] == "TpuPlatform" and info["in_process"] and not info["sleep_mode"]
        assert engine.generate([prompt_a], greedy)[0].token_ids == want_a
        state_b = {
            k: t.to(torch.bfloat16) for k, t in AutoModelForCausalLM.from_pretrained(b).state_dict().items()
        }
        stats = engine.update_weights(state_b)
        print("update:", stats)
        assert stats.version == 1 and stats.bytes_written > 0
        assert engine.generate([prompt_b], greedy)[0].token_ids == want_b
        bad = dict(state_b, **{"lm_head.weight": state_b["lm_head.weight"][:-1]})
        with pytest.raises(WeightMismatchError, match="lm_head.weight"):
            engine.update_weights(bad)
        assert engine.generate([prompt_b], greedy)[0].token_ids == want_b  # refused: nothing written
        with pytest.raises(SleepModeUnavailable, match="TpuPlatform") as asleep:
            engine.sleep()
        print("sleep:", asleep.value)
        assert not engine.asleep


def test_vllm_refuses_its_sleep_mode_on_this_platform(tpu, models):
    """What vLLM itself says when asked for its sleep mode here (why tpuray does not ask for it)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    with pytest.raises(Exception, match="Sleep mode is not supported on current platform") as refused:
        AsyncEngineArgs(model=models[0], enable_sleep_mode=True, max_model_len=256).create_engine_config()
    print("vLLM:", refused.value)
