"""Fixtures for tpuray.rl tests: two tiny local Llama-style models of the same shapes (different seeds)
and the greedy tokens of each (loaded from disk into an in-process engine)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    from tpuray.models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("rl-models")
    return (
        str(build_tiny_causal_lm(root / "a", max_position_embeddings=256, seed=0)),
        str(build_tiny_causal_lm(root / "b", max_position_embeddings=256, seed=1)),
    )


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> tuple[str, str]:
    """Two models vLLM's CPU attention can run (head_dim 32), same shapes, different weights; one KV head
    (so under TP=4 every vLLM rank holds a copy of it: tpuray.rl.weights.vllm_layout)."""
    from tpuray.models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("rl-vllm-models")
    kw = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
    }
    return (
        str(build_tiny_causal_lm(root / "a", seed=0, **kw)),
        str(build_tiny_causal_lm(root / "b", seed=1, **kw)),
    )


@pytest.fixture(scope="session")
def reference(tiny_models) -> dict[str, list[list[int]]]:
    from _rl_util import greedy

    from tpuray.rl import RolloutConfig, rollout_engine

    out = {}
    for name, path in zip("ab", tiny_models, strict=True):
        with rollout_engine(RolloutConfig(path, max_model_len=64, max_num_seqs=4)) as engine:
            out[name] = greedy(engine)
    assert out["a"] != out["b"]
    return out
