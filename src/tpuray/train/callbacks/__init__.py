"""Driver-side callbacks (`RunConfig(callbacks=[...])`): the `Callback` base class and what its hooks see.

A `Callback` sees the run start, every report (once every rank has made it), every committed checkpoint,
every restart and the end of `fit()`, all on the driver; `tpuray.train.callbacks.hooks` delivers those events.
A callback that raises fails the run with `CallbackError` naming it; nothing a callback raises is
swallowed.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuray.train import checkpoint as ckpt
from tpuray.train.result import Result, TrainingFailedError
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.scaling import ScalingConfig

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
