"""`RunState`: the driver's bookkeeping of reports and checkpoints across attempts.

Every rank numbers its report() calls 0, 1, 2, ... (continuing after a restart). Report i is *committed*
once every rank's record of it has been drained; a worker hands over a report's record only once its
checkpoint files are all uploaded, in report order (`tpuray.train.upload.UploadQueue`), so a committed
checkpoint_i has every rank's files, even with asynchronous uploads. On a restart the run resumes
after the latest committed checkpoint; rank-0 history past it is dropped, so the final metrics_history
has every report exactly once. Committed progress is persisted to `<run_path>/run_state.json`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tpuray.train import checkpoint as ckpt

RUN_STATE_FILE = "run_state.json"


class RunState:
    """Reports and checkpoints seen so far, across attempts."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.history: dict[int, dict[str, Any]] = {}  # rank-0 metrics by report index
        self.ckpt_indices: set[int] = set()
        self.counts: list[int] = [0] * world_size  # reports seen per rank (absolute index + 1)
        self.base = 0  # first report index of the current attempt
        self.latest_ckpt: int | None = None
        # Kept committed checkpoints [{"index", "metrics"}], worst first (tpuray.train.checkpoint_manager).
        self.checkpoint_records: list[dict[str, Any]] = []

    def add(self, rank: int, records: list, on_metrics: Callable[[dict], None]) -> None:
        for r in records:
            if r.has_checkpoint:
                self.ckpt_indices.add(r.index)
            if rank == 0 and r.metrics is not None:
                self.history[r.index] = r.metrics
                on_metrics(r.metrics)
            self.counts[rank] = max(self.counts[rank], r.index + 1)

    def commit(self) -> int | None:
        """Advance latest_ckpt to the newest checkpoint every rank has finished; return it if new."""
        committed = min(self.counts)
        done = [i for i in self.ckpt_indices if i < committed]
        newest = max(done) if done else None
        if newest is not None and newest != self.latest_ckpt:
            self.latest_ckpt = newest
            return newest
        return None

    def rewind(self) -> int:
        """Start the next attempt right after the latest committed checkpoint."""
        resume = self.latest_ckpt + 1 if self.latest_ckpt is not None else 0
        self.history = {i: m for i, m in self.history.items() if i < resume}
        self.ckpt_indices = {i for i in self.ckpt_indices if i < resume}
        self.counts = [resume] * self.world_size
        self.base = resume
        return resume

    def metrics_history(self, upto: int | None = None) -> list[dict[str, Any]]:
        return [self.history[i] for i in sorted(self.history) if upto is None or i <= upto]

    def save(self, run_path: str, finished: bool = False) -> None:
        """Persist committed progress to <run_path>/run_state.json (read back by load() on resume)."""
        if finished:
            history = self.metrics_history()
        else:
            history = self.metrics_history(self.latest_ckpt) if self.latest_ckpt is not None else []
        doc = {
            "latest_checkpoint": self.latest_ckpt,
            "finished": finished,
            "metrics_history": history,
            "kept_checkpoints": self.checkpoint_records,
        }
        ckpt.write_text(ckpt.join(run_path, RUN_STATE_FILE), json.dumps(doc, default=str, indent=1))

    def load(self, run_path: str) -> bool:
        text = ckpt.read_text(ckpt.join(run_path, RUN_STATE_FILE))
        doc = json.loads(text) if text else {}
        latest = doc.get("latest_checkpoint")
        if latest is None or latest not in ckpt.list_checkpoints(run_path):
            return False
        self.latest_ckpt = latest
        self.ckpt_indices.add(latest)
        self.history = dict(enumerate(doc.get("metrics_history", [])[: latest + 1]))
        self.checkpoint_records = list(doc.get("kept_checkpoints", []))
        return True
