"""Console progress for fit(): one tqdm line with the report count, epoch/step and latest rank-0 metrics.

On a terminal the line updates in place; elsewhere (a log file, CI) a plain line at most every
PLAIN_EVERY_S seconds and one at the end, with no carriage returns. Quiet with RunConfig(verbose=0) or
TPURAY_QUIET=1 (CI): only restarts and failures are logged then.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

logger = logging.getLogger("tpuray.train")
PLAIN_EVERY_S = 10.0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class _Lines:
    """tqdm's calls, written as plain lines (a log file or a pipe gets no carriage returns)."""

    def __init__(self, desc: str, initial: int) -> None:
        self.desc, self.n, self.shown = desc, initial, ""
        self._last = time.monotonic()

    def set_postfix(self, shown: dict[str, str], refresh: bool = False) -> None:
        self.shown = ", ".join(f"{k}={v}" for k, v in shown.items())

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self._last >= PLAIN_EVERY_S:
            self._print()

    def write(self, message: str, file: Any = None) -> None:
        print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._print()

    def _print(self) -> None:
        self._last = time.monotonic()
        print(
            f"{self.desc}: {self.n} reports" + (f" ({self.shown})" if self.shown else ""),
            file=sys.stderr,
            flush=True,
        )


class Progress:
    def __init__(self, title: str, quiet: bool) -> None:
        self.title = title
        self.quiet = quiet
        self._bar: Any = None

    def start(self, attempt: int, initial: int) -> None:
        if self.quiet:
            return
        desc = self.title if attempt == 0 else f"{self.title} (restart {attempt})"
        if not sys.stderr.isatty():
            self._bar = _Lines(desc, initial)
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(desc=desc, unit="report", initial=initial, file=sys.stderr, dynamic_ncols=True)

    def update(self, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        shown = {k: _fmt(v) for k, v in list(metrics.items())[:6] if isinstance(v, (int, float, str))}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(1)

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            logger.warning(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
