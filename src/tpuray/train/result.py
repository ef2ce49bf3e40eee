"""Result of `fit()` and the errors it raises (mirroring ray.train V2: fit() raises TrainingFailedError)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpuray.train.checkpoint import Checkpoint


class TrainingFailedError(RuntimeError):
    """Training did not finish: a worker raised, or worker/host failures exceeded max_failures."""

    result: Result | None = None


class WorkerGroupError(TrainingFailedError):
    """One or more workers failed. `worker_failures` maps world rank -> exception; the message carries
    the failing workers' tracebacks."""

    def __init__(self, message: str, worker_failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.worker_failures = worker_failures

    def __reduce__(self):
        return (self.__class__, (self.args[0], self.worker_failures))


@dataclass
class Result:
    """metrics: rank 0's last report; metrics_history: every rank-0 report in order (exactly once per
    report, across restarts); checkpoint: latest committed checkpoint; path: the run directory;
    best_checkpoints: the kept checkpoints' (Checkpoint, metrics), ranked by
    CheckpointConfig.checkpoint_score_attribute (else by age), worst first and best last, as in Ray."""

    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    error: BaseException | None = None
    path: str = ""
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    return_value: Any = None
    num_failures: int = 0  # restarts after worker/host failures (FailureConfig.max_failures)
    num_preemptions: int = 0  # restarts after preemption notices (FailureConfig.max_preemption_failures)
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The checkpoint of best_checkpoints with the highest (mode="max") or lowest ("min") `metric`."""
        if mode not in ("max", "min"):
            raise ValueError(f"get_best_checkpoint(mode={mode!r}) is invalid; valid: 'max', 'min'")
        scored = [
            (float(m[metric]), i)
            for i, (_, m) in enumerate(self.best_checkpoints)
            if isinstance(m.get(metric), (int, float)) and m[metric] == m[metric]  # not NaN
        ]
        if not scored:
            if not self.best_checkpoints:
                return None
            raise ValueError(f"get_best_checkpoint: no kept checkpoint reported a numeric {metric!r}")
        best = max(scored) if mode == "max" else min(scored, key=lambda s: (s[0], -s[1]))
        return self.best_checkpoints[best[1]][0]

    @property
    def metrics_dataframe(self):
        """Every reported metrics dict as a pandas DataFrame (needs pandas: the `train` extra)."""
        from tpuray.optional import require

        pd = require("pandas", "train", "Result.metrics_dataframe")
        return pd.DataFrame(self.metrics_history)

    def __repr__(self) -> str:
        return (
            f"Result(metrics={self.metrics!r}, checkpoint={self.checkpoint!r}, error={self.error!r}, "
            f"path={self.path!r}, reports={len(self.metrics_history)}, num_failures={self.num_failures}, "
            f"num_preemptions={self.num_preemptions})"
        )
