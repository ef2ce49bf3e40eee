"""`RunHooks`: how the trainer calls the run's callbacks (`tpuray.train.callbacks.Callback`), on the driver.

Reports are delivered in report order, each once every rank has made it (a checkpointed one once its
checkpoint is committed: `tpuray.train.checkpoint.manager`). A callback that raises fails the run with
`CallbackError` naming it; `on_end` runs for every started callback on every path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpuray.train import checkpoint as ckpt
from tpuray.train.callbacks import Callback, CallbackError, RunInfo
from tpuray.train.result import Result, TrainingFailedError

if TYPE_CHECKING:
    from tpuray.train.checkpoint.manager import RunState

logger = logging.getLogger("tpuray.train")


def _label(callback: Callback) -> str:
    return type(callback).__name__


class RunHooks:
    """What the trainer calls: start -> after_collect(state, register)* / restart* -> end | failed."""

    def __init__(self, callbacks: list[Callback], run_path: str) -> None:
        self.callbacks = list(callbacks)
        self.run_path = run_path
        self._started: list[Callback] = []
        self._next: int | None = None  # next report index to deliver (None: the attempt's first)

    # -- dispatch ------------------------------------------------------------------------------
    def _call(self, callback: Callback, hook: str, *args: Any, **kwargs: Any) -> None:
        try:
            getattr(callback, hook)(*args, **kwargs)
        except Exception as exc:
            raise CallbackError(
                f"Training failed: callback {_label(callback)}.{hook} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _each(self, hook: str, *args: Any, **kwargs: Any) -> None:
        for callback in self.callbacks:
            self._call(callback, hook, *args, **kwargs)

    # -- events ---------------------------------------------------------------------------------
    def start(self, run: RunInfo) -> None:
        for callback in self.callbacks:
            self._call(callback, "on_start", run)
            self._started.append(callback)

    def after_collect(self, state: RunState, register: Callable[[int, dict[str, Any]], None]) -> None:
        """Deliver, in order, each report every rank has made (a checkpointed one once it is committed):
        `register` its checkpoint (for retention: CheckpointManager.register), then on_report, then
        on_checkpoint."""
        if self._next is None:
            self._next = state.base
        reached = min(state.counts)
        latest = state.latest_ckpt
        while self._next < reached:
            index = self._next
            has_ckpt = index in state.ckpt_indices
            if has_ckpt and (latest is None or index > latest):
                break  # not committed yet: deliver it (and what follows) once it is
            metrics = state.history.get(index, {})
            checkpoint = ckpt.Checkpoint(ckpt.checkpoint_dir(self.run_path, index)) if has_ckpt else None
            if checkpoint is not None:
                register(index, metrics)
            self._next = index + 1
            self._each("on_report", dict(metrics), checkpoint, index=index)
            if checkpoint is not None:
                self._each("on_checkpoint", checkpoint, dict(metrics))

    def restart(self, attempt: int, error: BaseException) -> None:
        self._next = None  # the next attempt starts after the checkpoint it resumes from
        self._each("on_restart", attempt, error)

    def end(self, result: Result) -> Result:
        """fit() succeeded: on_end for every callback; the first one that raises fails the run."""
        first: CallbackError | None = None
        for callback in self._started:
            try:
                self._call(callback, "on_end", result)
            except CallbackError as err:
                first = first or err
        if first is not None:
            result.error = first
            first.result = result
            raise first
        return result

    def failed(self, error: BaseException, result: Result | None) -> None:
        """fit() is raising `error`: on_end(result with error set) for every started callback. A callback
        that raises here is logged (the run's own error is the one raised)."""
        if result is None:
            result = Result(metrics=None, checkpoint=None, error=error, path=self.run_path)
        if isinstance(error, TrainingFailedError) and error.result is None:
            error.result = result
        for callback in self._started:
            try:
                self._call(callback, "on_end", result)
            except CallbackError:
                logger.exception("tpuray.train: while failing with %r", error)
