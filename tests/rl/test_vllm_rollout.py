"""tpuray.rl.RolloutEngine over real vLLM (its CPU build): engine choice at construction, and one run
folding generate, update_weights (output changes; a mismatch is refused, the old weights kept) and
sleep / wake_up's clear error on vLLM's CPU backend.

vLLM runs in a child process (with a timeout), as in tests/serve/test_engine_proof.py: vLLM's engine core
is a spawned child of its client, and a client of a dead engine core can hang at garbage collection."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"
)


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory) -> tuple[str, str]:
    """Two models vLLM's CPU attention can run (head_dim 32), same shapes, different weights."""
    from tpuray.models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("rl-vllm-models")
    kw = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 256}
    return (
        str(build_tiny_causal_lm(root / "a", seed=0, **kw)),
        str(build_tiny_causal_lm(root / "b", seed=1, **kw)),
    )


def test_engine_choice(vllm_models, tiny_models, caplog):
    from tpuray.rl import RolloutConfig
    from tpuray.validation import ConfigError

    assert RolloutConfig(vllm_models[0]).resolved_engine == "vllm"  # auto: vLLM where it can run the model
    assert RolloutConfig(vllm_models[0], engine="embedded").resolved_engine == "embedded"
    with caplog.at_level(logging.WARNING):
        assert RolloutConfig(tiny_models[0]).resolved_engine == "embedded"  # head_dim 8
    assert "head_dim=8" in caplog.text and "embedded engine, not vLLM" in caplog.text
    with pytest.raises(ConfigError, match=r"llm_engine='vLLM' cannot serve .*head_dim=8"):
        RolloutConfig(tiny_models[0], engine="vllm")
    with pytest.raises(ConfigError, match=r"engine='vLLM' is invalid; valid: auto, vllm, embedded"):
        RolloutConfig(vllm_models[0], engine="vLLM")  # type: ignore[arg-type]
    slice_kw = {"accelerator_type": "TPU-V6E", "topology": "2x2", "chips_per_worker": 2}
    assert RolloutConfig(vllm_models[0], **slice_kw).resolved_engine == "embedded"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="TPU=2 is not supported with vLLM"):
        RolloutConfig(vllm_models[0], engine="vllm", **slice_kw)  # type: ignore[arg-type]
    # an RLRun's weight sync (each TP rank its part) loads into the embedded engine's workers only
    from _rl_util import SCALING

    from tpuray.rl import RLConfig
    from tpuray.train import ScalingConfig

    on_vllm = RolloutConfig(vllm_models[0], engine="vllm", accelerator_type="TPU-V6E", topology="2x2")
    trainer = ScalingConfig(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E")
    with pytest.raises(ConfigError, match=r"resolved to 'vllm' .*valid: RolloutConfig\(engine='embedded'\)"):
        RLConfig(on_vllm, trainer)
    with pytest.raises(ConfigError, match=r"colocated' with RolloutConfig.engine='auto' \(runs vLLM\).*CPU"):
        RLConfig(RolloutConfig(vllm_models[0]), ScalingConfig(**SCALING), placement="colocated")  # no sleep


CHILD = """
import sys, torch
from transformers import AutoModelForCausalLM
from tpuray.rl import RolloutConfig, RolloutEngine, WeightMismatchError
from tpuray.rl.vllm_rollout import SleepModeUnavailable, VLLMRolloutEngine
from tpuray.rl.vllm_worker import pack_state
from tpuray.serve.llm.engine.embedded.sampling import SamplingParams

def main(a, b):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["Hello world", "1 + 2 =", "The"]
    state_a = AutoModelForCausalLM.from_pretrained(a).state_dict()
    state_b = AutoModelForCausalLM.from_pretrained(b).state_dict()
    with RolloutEngine(RolloutConfig(a, max_model_len=64, max_num_seqs=4, dtype="float32")) as engine:
        assert isinstance(engine, VLLMRolloutEngine), type(engine)
        assert engine.describe()["engine"] == "vLLM"
        out = engine.generate(prompts, greedy)
        tokens_a = [r.token_ids for r in out]
        assert [len(t) for t in tokens_a] == [8] * 3 and all(r.finish_reason == "length" for r in out)
        assert all(len(r.logprobs) == 8 and all(lp <= 0 for lp in r.logprobs) for r in out)
        assert out[0].prompt_token_ids == engine.tokenizer.encode(prompts[0], add_special_tokens=False)
        assert out[0].text == engine.tokenizer.decode(out[0].token_ids, skip_special_tokens=True)
        sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
        rows = [r.token_ids for r in engine.generate(["1 + 2 ="] * 4, sampled)]
        assert len({tuple(r) for r in rows} ) > 1, rows  # seed + i per prompt: distinct
        assert rows == [r.token_ids for r in engine.generate(["1 + 2 ="] * 4, sampled)]  # reproducible

        stats = engine.update_weights(state_b)
        assert stats.version == 1 and stats.bytes_written > 0, stats
        tokens_b = [r.token_ids for r in engine.generate(prompts, greedy)]
        assert tokens_b != tokens_a, tokens_b

        bad = dict(state_a, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 128)})
        try:
            engine.update_weights(bad)
            raise AssertionError("a misshapen update was accepted")
        except WeightMismatchError as e:
            assert "'model.layers.0.mlp.up_proj.weight' has shape (3, 128)" in str(e), e
        try:  # past the driver's check: each vLLM worker refuses it before any rank loads
            engine._loop.run(engine._load(pack_state(bad)))
            raise AssertionError("the workers accepted a misshapen update")
        except WeightMismatchError as e:
            assert "up_proj.weight" in str(e), e
        assert [r.token_ids for r in engine.generate(prompts, greedy)] == tokens_b  # old weights kept
        assert engine.version == 1

        try:
            engine.sleep()
            raise AssertionError("sleep() on vLLM's CPU backend did not raise")
        except SleepModeUnavailable as e:
            assert "sleep mode is not available on platform CpuPlatform" in str(e), e
        assert not engine.asleep
        engine.update_weights(state_a)
        assert [r.token_ids for r in engine.generate(prompts, greedy)] == tokens_a  # a's output again
    try:
        engine.generate(prompts, greedy)
        raise AssertionError("generate after shutdown")
    except RuntimeError as e:
        assert "after shutdown" in str(e)
    print("VLLM-ROLLOUT-OK", flush=True)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""


def test_vllm_rollout_generate_update_and_sleep(vllm_models, tmp_path):
    """generate (tokens, logprobs, text, seeded batches), update_weights changes the output and back,
    a misshapen update is refused by the driver and by the workers with the old weights kept,
    sleep() names why vLLM's CPU backend cannot sleep; shutdown is explicit."""
    script = tmp_path / "vllm_rollout_child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("RAY_ADDRESS", None)  # in this machine's CPU, no cluster
    out = subprocess.run(
        [sys.executable, str(script), *vllm_models],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0 and "VLLM-ROLLOUT-OK" in out.stdout, tail
