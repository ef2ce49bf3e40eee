"""fit()'s console progress off a terminal: plain lines, no carriage returns or colour."""

from __future__ import annotations

import io
import sys

from tpuray.train.callbacks.progress import Progress


def test_progress_off_a_terminal_writes_plain_lines(monkeypatch) -> None:
    err = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", err)
    progress = Progress("tpuray.train run", quiet=False)
    progress.start(attempt=0, initial=0)
    for step in range(3):
        progress.update({"step": step, "loss": 1.0 / (step + 1)})
    progress.close()
    out = err.getvalue()
    assert "\r" not in out and "\x1b" not in out
    assert out.splitlines()[-1] == "tpuray.train run: 3 reports (step=2, loss=0.3333)"
