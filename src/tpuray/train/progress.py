"""Console progress for fit(): one tqdm line with the report count, epoch/step and latest rank-0 metrics.

Quiet with RunConfig(verbose=0) or TPURAY_QUIET=1 (CI): only restarts and failures are logged then.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("tpuray.train")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    def __init__(self, title: str, quiet: bool) -> None:
        self.title = title
        self.quiet = quiet
        self._bar = None

    def start(self, attempt: int, initial: int) -> None:
        if self.quiet:
            return
        from tqdm.auto import tqdm

        desc = self.title if attempt == 0 else f"{self.title} (restart {attempt})"
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
