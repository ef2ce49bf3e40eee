"""docs/configuration.md names every TPURAY_* environment variable tpuray reads (one row each), and each
is defined once, in tpuray.constants, so a setting added in the code cannot go undocumented."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_tpuray_variable_has_a_row():
    read = set()
    for path in (ROOT / "src" / "tpuray").rglob("*.py"):
        read |= set(re.findall(r"[\"'](TPURAY_[A-Z0-9_]+)[\"']", path.read_text()))
    table = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(TPURAY_[A-Z0-9_]+)`", table, flags=re.M))
    assert read, "no TPURAY_* variable found in src/tpuray"
    assert sorted(read - documented) == []
    defined = set(
        re.findall(r"[\"'](TPURAY_[A-Z0-9_]+)[\"']", (ROOT / "src" / "tpuray" / "constants.py").read_text())
    )
    assert sorted(read - defined) == []  # the one place each name is written
