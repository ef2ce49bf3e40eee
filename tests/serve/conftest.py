"""Fixtures for tpuray.serve tests: a tiny local Llama-style model (16 heads: TP 1/2/4/8/16 all divide)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tpuray.models import build_tiny_causal_lm

    return str(
        build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llm") / "model", max_position_embeddings=512)
    )
