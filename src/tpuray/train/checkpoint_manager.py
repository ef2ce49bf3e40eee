"""Which committed checkpoints to keep: the latest N, or the best N by a reported metric.

`CheckpointConfig(num_to_keep, checkpoint_score_attribute, checkpoint_score_order)` as in Ray Train:
with a score attribute, checkpoints are ranked by rank 0's value of that metric in the report that made
the checkpoint (ties: the newer one ranks higher; NaN ranks lowest), and the best `num_to_keep` are kept.
The latest committed checkpoint is always kept as well, even when it is not among the best, because a
restart resumes from it; so up to `num_to_keep + 1` checkpoints can be on disk. Without a score
attribute the latest `num_to_keep` are kept. `best_checkpoints()` lists the best N in Ray's order:
worst first, best last. The kept set is persisted in run_state.json (`RunState.checkpoint_records`), so
a run resumed under the same name keeps ranking its earlier checkpoints.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import TYPE_CHECKING, Any

from tpuray.train import checkpoint as ckpt
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.config import CheckpointConfig
    from tpuray.train.run_state import RunState

logger = logging.getLogger("tpuray.train")


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

    def best_checkpoints(self) -> list[tuple[ckpt.Checkpoint, dict[str, Any]]]:
        """The best `num_to_keep` (all when None) as (Checkpoint, metrics), worst first, as in Ray."""
        ordered = self.ordered()
        keep = self.config.num_to_keep
        if keep is not None:
            ordered = ordered[-keep:]
        return [(ckpt.Checkpoint(ckpt.checkpoint_dir(self.run_path, i)), dict(m)) for i, m in ordered]
