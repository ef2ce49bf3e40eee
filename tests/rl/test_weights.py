"""tpuray.rl.weights: the HF-name -> engine-tensor mapping cuts exactly the shards `ShardedLlama` loads
from disk (every TP rank), and the checks name the first mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpuray.rl.weights import (
    WeightMismatchError,
    check_state,
    engine_tensors,
    expected_shapes,
    shapes_of,
    shard_state,
)
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
