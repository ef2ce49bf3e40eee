"""Driver-side callbacks (`RunConfig(callbacks=[...])`) and the hooks the trainer calls them through.

A `Callback` sees the run start, every report (once every rank has made it), every committed checkpoint,
every restart and the end of `fit()`, all on the driver. `RunHooks` delivers those events in report
order and keeps the best-checkpoint bookkeeping (`tpuray.train.checkpoint_manager`). A callback that
raises fails the run with `CallbackError` naming it; nothing a callback raises is swallowed.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuray.train import checkpoint as ckpt
from tpuray.train.checkpoint_manager import CheckpointManager
from tpuray.train.result import Result, TrainingFailedError
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.config import CheckpointConfig, ScalingConfig
    from tpuray.train.run_state import RunState

logger = logging.getLogger("tpuray.train")


@dataclass(frozen=True)
class RunInfo:
    """What a callback knows about the run when it starts (`Callback.on_start`)."""

    name: str
    storage_path: str
    run_path: str  # <storage_path>/<name>: checkpoints, run_state.json, default TensorBoard logs
    scaling_config: ScalingConfig
    train_loop_config: dict[str, Any] | None


class Callback:
    """Base class of driver-side callbacks: override the hooks you need (every hook is a no-op here).

    Hooks run on the driver, in the order the callbacks are listed, between polls of the workers: keep
    them quick. Mirrors `ray.tune.Callback` / `ray.train.UserCallback` (different hook names).
    """

    def on_start(self, run: RunInfo) -> None:
        """fit() is starting (before anything is reserved)."""

    def on_report(self, metrics: dict[str, Any], checkpoint: ckpt.Checkpoint | None, *, index: int) -> None:
        """Every rank has made report `index` (0, 1, 2, ... across restarts); `metrics` are rank 0's and
        `checkpoint` is the committed checkpoint of that report, if any. After a restart the reports past
        the resumed checkpoint are made (and delivered) again with the same indices."""

    def on_checkpoint(self, checkpoint: ckpt.Checkpoint, metrics: dict[str, Any]) -> None:
        """Checkpoint committed (every rank finished it); called before old or worse ones are pruned."""

    def on_restart(self, attempt: int, error: BaseException) -> None:
        """The run restarts all workers (attempt 1, 2, ...) after `error` (worker/host death, preemption)."""

    def on_end(self, result: Result) -> None:
        """fit() is returning `result` or raising (then `result.error` is set); called on every path."""


class CallbackError(TrainingFailedError):
    """A callback raised: the run is stopped (the callback's exception is the `__cause__`)."""


def check_callbacks(name: str, value: Any) -> list[Callback]:
    """`RunConfig.callbacks` as a list of Callback instances, else ConfigError naming the bad item."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ConfigError(f"{name}={value!r} is invalid: use a list of tpuray.train.Callback instances.")
    items = list(value)
    for i, item in enumerate(items):
        if isinstance(item, type) and issubclass(item, Callback):
            raise ConfigError(f"{name}[{i}]={item!r} is a class: pass an instance, e.g. {item.__name__}().")
        if not isinstance(item, Callback):
            raise ConfigError(
                f"{name}[{i}]={item!r} is invalid: callbacks must be tpuray.train.Callback instances "
                "(subclass it and override on_report / on_checkpoint / on_restart / on_end)."
            )
    return items


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics dict, nested dicts flattened with "/" (as Ray's loggers do);
    anything else (strings, lists, bools, tensors) is skipped and logged at debug level."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[prefix] = float(value)
        else:
            logger.debug("tpuray.train: metric %r=%r is not numeric; not logged", prefix, value)

    walk("", metrics)
    return out


def _label(callback: Callback) -> str:
    return type(callback).__name__


class RunHooks:
    """What the trainer calls: start -> attach(state) -> after_collect(state)* / restart* -> end | failed."""

    def __init__(self, callbacks: list[Callback], checkpoint_config: CheckpointConfig, run_path: str) -> None:
        self.callbacks = list(callbacks)
        self.run_path = run_path
        self.checkpoints = CheckpointManager(checkpoint_config, run_path)
        self.state: RunState | None = None
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

    def attach(self, state: RunState) -> None:
        """The run's state is known (loaded from run_state.json when resuming): restore kept checkpoints."""
        self.state = state
        self.checkpoints.restore(state)

    def after_collect(self, state: RunState) -> None:
        """Deliver, in order, each report every rank has made (a checkpointed one once it is committed):
        register its checkpoint for scoring, then on_report, then on_checkpoint."""
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
                self.checkpoints.register(index, metrics)
            self._next = index + 1
            self._each("on_report", dict(metrics), checkpoint, index=index)
            if checkpoint is not None:
                self._each("on_checkpoint", checkpoint, dict(metrics))
        self.checkpoints.sync(state)

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

    def best_checkpoints(self) -> list[tuple[ckpt.Checkpoint, dict[str, Any]]]:
        return self.checkpoints.best_checkpoints()
