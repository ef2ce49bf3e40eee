"""tpuray.rl.RolloutEngine over real vLLM (its CPU build): engine choice at construction, and one RLRun
with vLLM on an emulated slice folding generate, update_weights (output changes; a mismatch is refused,
the old weights kept), sleep / wake_up's clear error on vLLM's CPU backend, and the trainer's updates
reaching each vLLM worker as its own part.

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
    # an RLRun's weight sync reaches vLLM's workers over either transport (tpu_dist the default)
    from _rl_util import SCALING

    from tpuray.rl import RLConfig
    from tpuray.train import ScalingConfig

    on_vllm = RolloutConfig(vllm_models[0], engine="vllm", accelerator_type="TPU-V6E", topology="2x2")
    trainer = ScalingConfig(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E")
    assert RLConfig(on_vllm, trainer).weight_sync == "tpu_dist"
    RLConfig(on_vllm, trainer, weight_sync="object_store")
    colocated = RLConfig(RolloutConfig(vllm_models[0]), ScalingConfig(**SCALING), placement="colocated")
    assert colocated.rollout.resolved_engine == "vllm" and colocated.rollout_tensor_parallel_size == 2
    assert colocated.weight_sync == "tpu_dist"  # vLLM in the trainer's workers (test_vllm_colocated.py)
    with pytest.raises(ConfigError, match=r"sleep_level=2 is invalid with a vLLM rollout engine"):
        RLConfig(
            RolloutConfig(vllm_models[0]),
            ScalingConfig(**SCALING),
            placement="colocated",
            weight_sync="object_store",
            sleep_level=2,
        )


CHILD = """
import sys, ray, torch
from transformers import AutoModelForCausalLM
from tpuray.rl import RLConfig, RLRun, RolloutConfig, WeightMismatchError
from tpuray.rl.rollout.vllm import SleepModeUnavailable, VLLMRolloutEngine
from tpuray.rl.rollout.vllm_worker import pack_state
from tpuray.serve.llm.generation import SamplingParams
from tpuray.train import RunConfig, ScalingConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello world", "1 + 2 =", "The"]

def fsdp2_sender(config):
    import tpuray.train.torch as tt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tpuray import train
    rl = config["rl"]
    model = AutoModelForCausalLM.from_pretrained(config["path"], dtype=torch.float32).to(tt.get_device())
    model = fully_shard(model, mesh=init_device_mesh(tt.get_device().type, (train.get_context().get_world_size(),)))
    for k in range(rl.iterations):
        rl.batch(k)
        rl.send(model, version=k + 1)  # each rank its Shard(0) rows, cut per vLLM rank

def greedy(engine):
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]

def lost_update(engine, state):
    # a TrainerUpdate (per-rank pieces in vLLM's layout) whose rank-3 pieces are owned by a process that
    # is gone: every vLLM worker stages nothing, UpdateLostError
    import functools
    from _rl_util import orphaned
    from tpuray.rl import UpdateLostError
    from tpuray.rl.weights.cut import trainer_pieces
    from tpuray.rl.sync.update import TrainerUpdate
    from tpuray.rl.weights.vllm_layout import vllm_part

    part = functools.partial(vllm_part, config=engine.model_config)
    pieces = trainer_pieces(state, 0, 4, part)
    refs = tuple((ray.put(p),) for p in pieces[:3]) + ((orphaned(pieces[3]),),)
    nbytes = tuple(sum(t.numel() * t.element_size() for _, t in p.values()) for p in pieces)
    try:
        engine.update_weights(TrainerUpdate(refs, nbytes))
        raise AssertionError("an update whose pieces were lost was loaded")
    except UpdateLostError as e:
        assert "lost before every rollout worker had them; the engine keeps its weights" in str(e), e

def engine_checks(engine, state_a, state_b, seen):
    assert isinstance(engine, VLLMRolloutEngine), type(engine)
    assert engine.describe()["engine"] == "vLLM" and engine.tensor_parallel_size == 4
    out = engine.generate(PROMPTS, GREEDY)
    seen["a"] = tokens_a = [r.token_ids for r in out]
    assert [len(t) for t in tokens_a] == [8] * 3 and all(r.finish_reason == "length" for r in out)
    assert all(len(r.logprobs) == 8 and all(lp <= 0 for lp in r.logprobs) for r in out)
    assert out[0].prompt_token_ids == engine.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert out[0].text == engine.tokenizer.decode(out[0].token_ids, skip_special_tokens=True)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    rows = [r.token_ids for r in engine.generate(["1 + 2 ="] * 4, sampled)]
    assert len({tuple(r) for r in rows} ) > 1, rows  # seed + i per prompt: distinct
    assert rows == [r.token_ids for r in engine.generate(["1 + 2 ="] * 4, sampled)]  # reproducible
    stats = engine.update_weights(state_b)  # a full state dict: every worker gets all of it
    assert stats.version == 1 and stats.bytes_written > 0, stats
    seen["b"] = greedy(engine)
    assert seen["b"] != tokens_a, seen["b"]
    bad = dict(state_a, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 128)})
    try:
        engine.update_weights(bad)
        raise AssertionError("a misshapen update was accepted")
    except WeightMismatchError as e:
        assert "'model.layers.0.mlp.up_proj.weight' has shape (3, 128)" in str(e), e
    try:  # past the driver's check: each vLLM worker refuses it before any rank loads
        engine._loop.run(engine._load("tpuray_stage_weights", (pack_state(bad),)))
        raise AssertionError("the workers accepted a misshapen update")
    except WeightMismatchError as e:
        assert "up_proj.weight" in str(e), e
    assert greedy(engine) == seen["b"]  # old weights kept
    lost_update(engine, state_a)
    assert greedy(engine) == seen["b"]  # old weights kept
    try:
        engine.sleep()
        raise AssertionError("sleep() on vLLM's CPU backend did not raise")
    except SleepModeUnavailable as e:
        assert "sleep mode is not available on platform" in str(e), e
    assert not engine.asleep
    engine.update_weights(state_a)
    assert greedy(engine) == tokens_a  # a's output again
    return tokens_a

def main(a, b, storage, weight_sync):
    ray.init()  # RAY_ADDRESS: the test's emulated cluster
    state_a = AutoModelForCausalLM.from_pretrained(a).state_dict()
    state_b = AutoModelForCausalLM.from_pretrained(b).state_dict()
    seen = {}

    def rollout_fn(engine, k):
        if k == 0:
            seen["engine"] = engine
            return engine_checks(engine, state_a, state_b, seen)
        return greedy(engine)

    rollout = RolloutConfig(
        a, engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32",
        accelerator_type="TPU-V6E", topology="2x2",
    )
    trainer = ScalingConfig(
        num_workers=2, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E", resources_per_worker={"TPU": 2}
    )
    rl = RLRun(
        RLConfig(rollout, trainer, weight_sync=weight_sync), fsdp2_sender,
        train_loop_config={"path": b}, run_config=RunConfig(storage_path="file://" + storage, name="vllm-rl"),
    )
    result = rl.run(2, rollout_fn)
    assert result.versions == [1, 2], result.versions
    # batch 1: update 1, sent as per-rank pieces, gives b's tokens as b loaded whole did
    assert result.batches == [seen["a"], seen["b"]], result.batches
    full = sum(t.numel() * t.element_size() for t in state_b.values())
    assert result.times[0].sync_bytes < 2 * full, (result.times[0].sync_bytes, full)  # a broadcast: 4x
    try:
        seen["engine"].generate(PROMPTS, GREEDY)
        raise AssertionError("generate after shutdown")
    except RuntimeError as e:
        assert "after shutdown" in str(e)
    ray.shutdown()
    print("VLLM-ROLLOUT-OK", flush=True)

if __name__ == "__main__":
    main(*sys.argv[1:5])
"""


@pytest.mark.full(
    "CI: the RL run on slices with the embedded engine (rl/sync/test_sync.py), vLLM serving on a slice (serve/test_vllm.py), vLLM's weight layout (rl/weights/test_vllm_layout.py)"
)
@pytest.mark.parametrize("weight_sync", ["tpu_dist", "object_store"])
def test_vllm_rollouts_on_a_slice_in_an_rl_run(
    emulated_cluster, pg_leak_check, vllm_models, tmp_path, weight_sync
):
    """vLLM (TP=4, one worker per chip) on one emulated v6e 2x2 slice as an RLRun's rollout engine, a
    tpuray.train FSDP2 trainer on the other, over each weight_sync (tpu_dist: the vLLM workers join a
    process group with the trainer's ranks; object_store: they pull). Batch 0 folds the engine's own
    checks: generate (tokens, logprobs, text, seeded batches), update_weights of a full state changes the
    output and back, a misshapen update refused by the driver and by the workers with the old weights
    kept, an update whose pieces were lost with their owner raises UpdateLostError (weights kept),
    sleep() names why vLLM's CPU backend cannot sleep. Then the trainer's update 1 reaches each vLLM
    worker as only its part (pieces cut in vLLM's layout: the one KV head copied to all 4 ranks) and
    batch 1 shows the same tokens as the full load; shutdown is explicit. Nothing is left."""
    from _util import alive_actors

    script = tmp_path / "vllm_rollout_child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "RAY_ADDRESS": emulated_cluster.address,
    }
    out = subprocess.run(
        [sys.executable, str(script), *vllm_models, str(tmp_path / "runs"), weight_sync],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0 and "VLLM-ROLLOUT-OK" in out.stdout, tail
    assert not alive_actors("TrainWorker") and not alive_actors("RayWorkerWrapper")
    pg_leak_check()
