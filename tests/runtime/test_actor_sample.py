"""The seed's Ray actor all_reduce sample, unchanged, on the shared emulated v6e 2x2 slices."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "actor_all_reduce.py"
SEED = ROOT.parent / "shared" / "reference" / "seed-announcement.md"


def _squash(code: str) -> str:
    return re.sub(r"\n\s*\n+", "\n", code).strip()


def test_example_holds_the_seed_sample_verbatim():
    example = _squash(EXAMPLE.read_text())
    if SEED.exists():
        blocks = re.findall(r"``` python\n(.*?)```", SEED.read_text(), flags=re.S)
        sample = next(b for b in blocks if "class TorchWorker" in b)
        assert _squash(sample) in example  # blank lines aside, character for character
    sample_part = example.split("# ---")[1]
    assert "tpuray" not in sample_part


def test_seed_actor_sample_runs_unchanged(emulated_cluster):
    spec = importlib.util.spec_from_file_location("actor_all_reduce", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.run(world_size=4)
    assert [r.tolist() for r in results] == [[[6.0, 6.0], [6.0, 6.0]]] * 4
