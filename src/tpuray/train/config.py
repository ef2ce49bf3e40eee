"""Typed, validated configs: ScalingConfig (in `tpuray.train.scaling`), RunConfig, FailureConfig,
CheckpointConfig, TorchConfig.

Everything is checked in `__post_init__` so a bad config fails at construction, before anything is
reserved on the cluster. Field names mirror `ray.train` so scripts only need `ray.train` -> `tpuray.train`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from tpuray.constants import QUIET_ENV, STORAGE_PATH_ENV
from tpuray.train.callbacks import Callback, check_callbacks
from tpuray.train.checkpoint.uploads import CheckpointUploadMode, parse_upload_mode
from tpuray.train.scaling import ScalingConfig
from tpuray.validation import ConfigError, check_choice, check_positive_int, is_int, is_number

__all__ = ["CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig", "TorchConfig"]

DEFAULT_STORAGE_PATH = "~/tpuray_results"


@dataclass
class FailureConfig:
    """How often the whole run restarts from its latest committed checkpoint (-1 = unlimited).

    max_failures: after a worker or host death (or a worker crash).
    max_preemption_failures: after a preemption notice (a drain of a host of the slice, as on spot/
    preemptible TPU VMs), counted apart from max_failures as in Ray Train V2; default unlimited.
    """

    max_failures: int = 0
    max_preemption_failures: int = -1

    def __post_init__(self) -> None:
        for name in ("max_failures", "max_preemption_failures"):
            value = getattr(self, name)
            if not is_int(value) or value < -1:
                raise ConfigError(f"FailureConfig.{name}={value!r} is invalid: use -1 (unlimited) or >= 0.")


@dataclass
class CheckpointConfig:
    """Which committed checkpoints stay on disk (as in Ray Train).

    num_to_keep: keep N (None keeps all). checkpoint_score_attribute: rank the checkpoints by this metric
    of the report that made them (nested metrics as "a/b") and keep the best N; None keeps the latest N.
    checkpoint_score_order: "max" (higher is better) or "min". The latest checkpoint is always kept too,
    since a restart resumes from it (see tpuray.train.checkpoint.manager).
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    # "async" (default): report() returns before the upload ends; "sync": after (tpuray.train.checkpoint.uploads).
    checkpoint_upload_mode: CheckpointUploadMode | str = "async"

    def __post_init__(self) -> None:
        if self.num_to_keep is not None:
            check_positive_int("CheckpointConfig.num_to_keep", self.num_to_keep)
        attr = self.checkpoint_score_attribute
        if attr is not None and (not isinstance(attr, str) or not attr):
            raise ConfigError(
                f"CheckpointConfig.checkpoint_score_attribute={attr!r} is invalid: use a metric name "
                "(a key of the metrics you report with checkpoints) or None."
            )
        check_choice("CheckpointConfig.checkpoint_score_order", self.checkpoint_score_order, ("max", "min"))
        self.checkpoint_upload_mode = parse_upload_mode(
            self.checkpoint_upload_mode, "CheckpointConfig.checkpoint_upload_mode"
        )


@dataclass
class RunConfig:
    """Where results go and how failures/progress are handled.

    storage_path: local directory (default ~/tpuray_results) or any fsspec URL (file://, s3://, gs://...)
    that every worker can write to. verbose: 0 = quiet, 1 = progress line (TPURAY_QUIET=1 forces 0).
    callbacks: tpuray.train.Callback instances called on the driver (reports, checkpoints, restarts, end),
    e.g. MLflowLoggerCallback, TensorBoardLoggerCallback.
    """

    name: str | None = None
    storage_path: str | None = None
    failure_config: FailureConfig = field(default_factory=lambda: FailureConfig())  # None: the default
    checkpoint_config: CheckpointConfig = field(default_factory=lambda: CheckpointConfig())
    verbose: int = 1
    callbacks: list[Callback] | None = None

    def __post_init__(self) -> None:
        self.callbacks = check_callbacks("RunConfig.callbacks", self.callbacks)
        if self.name is not None and (not isinstance(self.name, str) or not self.name or "/" in self.name):
            raise ConfigError(f"RunConfig.name={self.name!r} is invalid: use a non-empty name without '/'.")
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise ConfigError(f"RunConfig.storage_path={self.storage_path!r} is invalid: use a path or URL.")
        if self.storage_path is not None:
            self.storage_path = os.fspath(self.storage_path)
            if self.storage_path.startswith("memory://"):
                raise ConfigError(
                    f"RunConfig.storage_path={self.storage_path!r} is invalid: fsspec's memory:// lives in "
                    "one process and workers run in other processes; use a directory, file://, or a "
                    "shared object store URL (s3://, gs://)."
                )
        if self.verbose not in (0, 1, 2):
            raise ConfigError(f"RunConfig.verbose={self.verbose!r} is invalid; valid: 0, 1, 2.")
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
        if self.name is None:
            self.name = f"TorchTrainer_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        if self.storage_path is None:
            self.storage_path = os.environ.get(STORAGE_PATH_ENV, DEFAULT_STORAGE_PATH)
        if "://" not in self.storage_path:
            self.storage_path = os.path.abspath(os.path.expanduser(self.storage_path))

    @property
    def quiet(self) -> bool:
        return self.verbose == 0 or os.environ.get(QUIET_ENV, "") not in ("", "0")


@dataclass
class TorchConfig:
    """torch.distributed setup: backend None picks tpu_dist / nccl / gloo from the ScalingConfig."""

    backend: str | None = None
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise ConfigError(f"TorchConfig.backend={self.backend!r} is invalid: use a backend name or None.")
        if not is_number(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"TorchConfig.timeout_s={self.timeout_s!r} is invalid: use seconds > 0.")
