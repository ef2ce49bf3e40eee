"""The seed's Ray actor all_reduce sample, unchanged, on the shared emulated v6e 2x2 slices."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "actor_all_reduce.py"
# The announcement's sample, shipped with the tests so the verbatim check runs on any clone.
SAMPLE = HERE / "seed_actor_sample.txt"
# The announcement itself, where a checkout has it beside it (shared/reference/).
SEED = ROOT.parent / "shared" / "reference" / "seed-announcement.md"


def _squash(code: str) -> str:
    return re.sub(r"\n\s*\n+", "\n", code).strip()


def test_example_holds_the_seed_sample_verbatim():
    example = _squash(EXAMPLE.read_text())
    sample = _squash(SAMPLE.read_text())
    assert "class TorchWorker" in sample and "dist.all_reduce" in sample
    assert sample in example  # blank lines aside, character for character
    sample_part = example.split("# ---")[1]
    assert _squash(sample_part).endswith(sample.splitlines()[-1])  # the marked part is the sample ...
    assert "tpuray" not in sample_part  # ... and imports nothing from tpuray


@pytest.mark.skipif(not SEED.exists(), reason=f"the announcement is not beside this checkout ({SEED})")
def test_shipped_sample_is_the_announcements():
    blocks = re.findall(r"``` python\n(.*?)```", SEED.read_text(), flags=re.S)
    (sample,) = [b for b in blocks if "class TorchWorker" in b]
    assert _squash(sample) == _squash(SAMPLE.read_text())


def test_seed_actor_sample_runs_unchanged(emulated_cluster):
    spec = importlib.util.spec_from_file_location("actor_all_reduce", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.run(world_size=4)
    assert [r.tolist() for r in results] == [[[6.0, 6.0], [6.0, 6.0]]] * 4
