"""tpuray.rl.weights (layout, cut, check): the HF-name -> engine-tensor mapping cuts exactly the shards
`ShardedLlama` loads from disk (every TP rank), and the checks name the first mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpuray.rl.weights.check import WeightMismatchError, check_state, shapes_of
from tpuray.rl.weights.cut import shard_state
from tpuray.rl.weights.layout import engine_tensors, expected_shapes
from tpuray.serve.llm.engine.embedded.model import ShardedLlama, load_state_dict


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_equal_what_the_engine_loads_from_disk(tiny_models, world_size):
    path = tiny_models[0]
    config = json.loads((Path(path) / "config.json").read_text())
    state = load_state_dict(path)
    check_state(shapes_of(state), config)
    for rank in range(world_size):
        model = ShardedLlama(path, rank, world_size)
        loaded = engine_tensors(model)
        shards = shard_state(state, config, rank, world_size)
        assert set(shards) == set(loaded)
        for key, t in loaded.items():
            assert torch.equal(shards[key], t), (rank, key)


def test_expected_names_follow_the_config():
    base = {
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 16,
        "vocab_size": 10,
        "num_hidden_layers": 1,
        "model_type": "llama",
    }
    shapes = expected_shapes(base)
    assert shapes["lm_head.weight"] == (10, 8)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4, 8)  # one KV head of dim 4
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (8, 8)
    tied = {**base, "tie_word_embeddings": True}
    without_head = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    check_state(without_head, tied)  # a tied model may leave lm_head out ...
    check_state(shapes, tied)  # ... or send it (HF's state_dict() does)
    with pytest.raises(WeightMismatchError, match=r"'lm_head.weight' \(shape \(10, 8\)\) is missing"):
        check_state(without_head, base)
    qwen = expected_shapes({**base, "model_type": "qwen2"})
    assert qwen["model.layers.0.self_attn.q_proj.bias"] == (8,)
    with pytest.raises(WeightMismatchError, match="self_attn.q_proj.bias' .* is missing"):
        check_state(shapes, {**base, "model_type": "qwen2"})


IN_PROCESS_WITHOUT_RAY = """
import sys

class NoRay:  # a TPU VM runs the engine in one process, without Ray installed
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"no module named {name!r} (blocked)")

sys.meta_path.insert(0, NoRay())
import torch
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.rl.weights.layout import engine_tensors
from tpuray.rl.rollout.embedded_worker import RunnerWeights
from tpuray.serve.llm.engine.embedded.model import load_state_dict
from tpuray.serve.llm.engine.embedded.runner import ModelRunner

a, b = sys.argv[1:3]
weights = RunnerWeights(ModelRunner(a, max_num_seqs=2, max_model_len=64), a, rank=0, world_size=1)
state = load_state_dict(b)
assert weights.stage(state) > 0 and weights.commit() > 0
assert weights.stage_shards(dict(engine_tensors(weights.runner.model))) > 0 and weights.commit() > 0
assert weights.sleep() > 0 and weights.wake_up() > 0
head = engine_tensors(weights.runner.model)["lm_head"]
assert torch.equal(head, state["lm_head.weight"]), "b's lm_head is in the engine"
# level 2: discarded; an update is checked against the shapes the weights had, then held for wake_up
shards = {k: t.clone() for k, t in engine_tensors(weights.runner.model).items()}
assert weights.sleep(2) > 0 and weights.restore is None
bad = dict(shards, lm_head=shards["lm_head"][:-1])
try:
    weights.stage_shards(bad)
    raise AssertionError("a misshapen shard was taken while asleep")
except WeightMismatchError as e:
    assert "'lm_head' has shape" in str(e), e
try:
    weights.wake_up()
    raise AssertionError("woke up without weights")
except RuntimeError as e:
    assert "needs a weight update first" in str(e) and weights.asleep, e
assert weights.stage_shards(shards) > 0 and weights.commit() > 0 and weights.wake_up() > 0
assert all(torch.equal(t, shards[k]) for k, t in engine_tensors(weights.runner.model).items())
# a colocated hand-over: the shards a trainer rank cut for this rank in this process, adopted at wake-up
from tpuray.rl.sync import handover

mine = handover.rank_shards(load_state_dict(a), 0, 1, weights.config)
handover.keep("w-1", mine)
assert weights.sleep(2) > 0 and weights.stage_pieces([handover.Handed("w-1")]) > 0 and weights.commit() > 0
assert weights.wake_up() > 0
engine = engine_tensors(weights.runner.model)
assert all(t.data_ptr() == mine[k].data_ptr() for k, t in engine.items()), "adopted, not copied"
try:
    weights.stage_pieces([handover.Handed("w-1")])  # taken already
    raise AssertionError("a hand-over was taken twice")
except handover.HandOverLost as e:
    assert "'w-1' is not in this process" in str(e), e
print("ok", weights.version, "ray" in sys.modules)
"""


def test_an_in_process_engine_takes_updates_without_ray(tiny_models):
    """`RunnerWeights` (the in-process engine's updates and sleep) never imports Ray: a TPU VM runs it in
    one process where Ray is not installed (tests/real_tpu/test_rollout_weights.py runs it there). Sleep
    at level 2 discards the weights: an update is checked against their shapes, and wake_up needs one. A
    colocated hand-over's shards (`tpuray.rl.sync.handover`) become the weights at wake-up without a copy,
    and are taken once."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", IN_PROCESS_WITHOUT_RAY, *tiny_models],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["ok", "4", "False"]


def test_a_hand_over_cuts_the_shards_the_engine_loads_from_disk(tiny_models):
    """`handover.rank_shards` (a colocated trainer rank; one rank here: several run the same over their
    process group in tests/rl/test_placement.py) gives exactly the shards `ShardedLlama` loads, in
    tensors of their own (never the trainer's); a misshapen tensor is refused naming it, before any
    collective."""
    from tpuray.rl.sync import handover

    path = tiny_models[0]
    config = json.loads((Path(path) / "config.json").read_text())
    state = load_state_dict(path)
    shards = handover.rank_shards(state, 0, 1, config)
    pointers = {t.untyped_storage().data_ptr() for t in state.values()}
    assert not pointers & {t.untyped_storage().data_ptr() for t in shards.values()}
    for key, t in engine_tensors(ShardedLlama(path, 0, 1)).items():
        assert torch.equal(shards[key], t), key
    bad = dict(state, **{"lm_head.weight": state["lm_head.weight"][:-1]})
    with pytest.raises(WeightMismatchError, match="lm_head.weight"):
        handover.rank_shards(bad, 0, 2, config)
