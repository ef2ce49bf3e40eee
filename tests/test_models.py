"""tpuray.models: the local models every test and example builds (no hub downloads)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_building_and_training_a_tiny_model_prints_nothing(tmp_path) -> None:
    """A library call writes no progress bar (transformers' bars put carriage returns into logs) and
    leaves transformers' own setting as it found it."""
    program = f"""
from transformers.utils import logging as hf_logging
from tpuray.models import build_tiny_causal_lm, train_tiny_causal_lm
build_tiny_causal_lm({str(tmp_path / "a")!r})
train_tiny_causal_lm({str(tmp_path / "b")!r}, steps=1)
assert hf_logging.is_progress_bar_enabled()
"""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}  # bars on by default
    out = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (out.stdout, out.stderr) == ("", ""), out.stderr[-2000:]
    assert (tmp_path / "b" / "config.json").exists()
