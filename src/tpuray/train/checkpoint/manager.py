"""The driver's checkpoint bookkeeping: which checkpoint is committed (`RunState`) and which committed
checkpoints are kept (`CheckpointManager`).

Commit rule. Every rank numbers its report() calls 0, 1, 2, ... (continuing after a restart). A worker
hands a report's record to the driver only once every file of that report's checkpoint is in storage,
in report order (`tpuray.train.checkpoint.uploads.UploadQueue`: a report made while an upload is in flight waits
behind it). Report i is *committed* once every rank's record of it has been drained (`RunState.commit()`),
so a committed checkpoint_i has every rank's files, even with asynchronous uploads. A worker that dies
or fails mid-upload never hands over record i, so checkpoint i is never committed: a restart resumes
after the latest committed checkpoint (`RunState.rewind()`), and the half-written `checkpoint_<i>`
directories past it are deleted when the next attempt starts (`CheckpointManager.drop_from()`). Rank-0
history past the resumed checkpoint is dropped, so the final metrics_history has every report exactly
once. Committed progress is persisted to `<run_path>/run_state.json`.

Retention. `CheckpointConfig(num_to_keep, checkpoint_score_attribute, checkpoint_score_order)` as in Ray
Train: with a score attribute, checkpoints are ranked by rank 0's value of that metric in the report that
made the checkpoint (ties: the newer one ranks higher; NaN ranks lowest), and the best `num_to_keep` are
kept. The latest committed checkpoint is always kept as well, even when it is not among the best, because
a restart resumes from it; so up to `num_to_keep + 1` checkpoints can be on disk. Without a score
attribute the latest `num_to_keep` are kept. `best_checkpoints()` lists the best N in Ray's order: worst
first, best last. The kept set is persisted in run_state.json (`RunState.checkpoint_records`), so a run
resumed under the same name keeps ranking its earlier checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpuray.train import checkpoint as ckpt
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.config import CheckpointConfig

logger = logging.getLogger("tpuray.train")

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
        # Kept committed checkpoints [{"index", "metrics"}], worst first (CheckpointManager.sync).
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


def _lookup(metrics: dict[str, Any], attribute: str) -> Any:
    """metrics[attribute], or a nested value named with "/" ("val/acc" -> metrics["val"]["acc"])."""
    if attribute in metrics:
        return metrics[attribute]
    value: Any = metrics
    for part in attribute.split("/"):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(attribute)
        value = value[part]
    return value


class CheckpointManager:
    def __init__(self, config: CheckpointConfig, run_path: str) -> None:
        self.config = config
        self.run_path = run_path
        self._entries: dict[int, dict[str, Any]] = {}  # committed checkpoints on disk: index -> metrics

    def score_key(self, index: int, metrics: dict[str, Any]) -> tuple[bool, float, int]:
        """Sort key, ascending = worse to better. ConfigError if the score metric is missing/non-numeric."""
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            return (True, 0.0, index)
        where = f"report {index} (checkpoint_{index:06d})"
        try:
            value = _lookup(metrics, attr)
        except KeyError:
            raise ConfigError(
                f"CheckpointConfig(checkpoint_score_attribute={attr!r}): {where} has no metric {attr!r}; "
                f"rank 0 reported {sorted(metrics)!r}. Report {attr!r} with every checkpoint, or change "
                "checkpoint_score_attribute."
            ) from None
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ConfigError(
                f"CheckpointConfig(checkpoint_score_attribute={attr!r}): {where} reported {attr}={value!r}, "
                "which is not a number; the score must be an int or float."
            )
        score = float(value)
        if math.isnan(score):
            return (False, 0.0, index)
        return (True, score if self.config.checkpoint_score_order == "max" else -score, index)

    def register(self, index: int, metrics: dict[str, Any]) -> None:
        """A newly committed checkpoint (scored now: a missing score metric fails here)."""
        self.score_key(index, metrics)
        self._entries[index] = dict(metrics)

    def restore(self, state: RunState) -> None:
        """Take back the kept checkpoints recorded in run_state.json (those still on disk)."""
        self._entries.clear()
        latest = state.latest_ckpt
        if latest is None:
            return
        on_disk = set(ckpt.list_checkpoints(self.run_path))
        for rec in state.checkpoint_records:
            index = rec.get("index")
            if isinstance(index, int) and index <= latest and index in on_disk:
                self._entries[index] = dict(rec.get("metrics") or {})
        if latest not in self._entries:  # run_state.json written before best-checkpoint tracking
            self._entries[latest] = dict(state.history.get(latest, {}))
        for index, metrics in self._entries.items():
            self.score_key(index, metrics)
        self.sync(state)

    def ordered(self) -> list[tuple[int, dict[str, Any]]]:
        """Every tracked checkpoint, worst first, best last."""
        return sorted(self._entries.items(), key=lambda item: self.score_key(*item))

    def prune(self, state: RunState) -> list[int]:
        """Delete checkpoints outside the best `num_to_keep` (never the latest); return their indices."""
        keep = self.config.num_to_keep
        if keep is None or not self._entries:
            return []
        latest = state.latest_ckpt if state.latest_ckpt is not None else max(self._entries)
        kept = {index for index, _ in self.ordered()[-keep:]} | {latest}
        dropped = sorted(i for i in self._entries if i not in kept)
        for index in dropped:
            ckpt.delete(ckpt.checkpoint_dir(self.run_path, index))
            state.ckpt_indices.discard(index)
            del self._entries[index]
        if dropped:
            logger.debug("tpuray.train: pruned checkpoints %s (kept %s)", dropped, sorted(kept))
        self.sync(state)
        return dropped

    def sync(self, state: RunState) -> None:
        """Record the kept checkpoints on the state (persisted with run_state.json)."""
        state.checkpoint_records = [{"index": i, "metrics": m} for i, m in self.ordered()]

    def drop_from(self, resume: int) -> None:
        """Delete the checkpoint directories from report `resume` on (uncommitted, or past the checkpoint
        the next attempt resumes from)."""
        for index in ckpt.list_checkpoints(self.run_path):
            if index >= resume:
                ckpt.delete(ckpt.checkpoint_dir(self.run_path, index))

    def best_checkpoints(self) -> list[tuple[ckpt.Checkpoint, dict[str, Any]]]:
        """The best `num_to_keep` (all when None) as (Checkpoint, metrics), worst first, as in Ray."""
        ordered = self.ordered()
        keep = self.config.num_to_keep
        if keep is not None:
            ordered = ordered[-keep:]
        return [(ckpt.Checkpoint(ckpt.checkpoint_dir(self.run_path, i)), dict(m)) for i, m in ordered]
