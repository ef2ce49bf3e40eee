"""Fixtures for tpuray.rl tests: two tiny local Llama-style models of the same shapes (different seeds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    from tpuray.models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("rl-models")
    return (
        str(build_tiny_causal_lm(root / "a", max_position_embeddings=256, seed=0)),
        str(build_tiny_causal_lm(root / "b", max_position_embeddings=256, seed=1)),
    )
