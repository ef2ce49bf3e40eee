"""`tpuray.train`: drop-in for `ray.train` (TorchTrainer on TPU slices, GPUs or CPUs), built on Ray Core.

    from tpuray import train
    from tpuray.train import ScalingConfig
    from tpuray.train.torch import TorchTrainer

Importing this package loads neither torch nor ray; `tpuray.train.torch` does.
"""

from __future__ import annotations

import importlib
from typing import Any

from tpuray.slices.drain import PreemptionInfo
from tpuray.train.callbacks import Callback, CallbackError, RunInfo
from tpuray.train.callbacks.loggers import MLflowLoggerCallback, TensorBoardLoggerCallback
from tpuray.train.checkpoint import Checkpoint
from tpuray.train.checkpoint.uploads import CheckpointUploadError, CheckpointUploadMode
from tpuray.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TorchConfig
from tpuray.train.data import DataConfig, get_dataset_shard
from tpuray.train.result import Result, TrainingFailedError, WorkerGroupError
from tpuray.train.session import TrainContext, get_checkpoint, get_context, get_preemption_info, report

__all__ = [
    "Callback",
    "CallbackError",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointUploadError",
    "CheckpointUploadMode",
    "DataConfig",
    "DataParallelTrainer",
    "FailureConfig",
    "MLflowLoggerCallback",
    "PreemptionInfo",
    "Result",
    "RunConfig",
    "RunInfo",
    "ScalingConfig",
    "TensorBoardLoggerCallback",
    "TorchConfig",
    "TrainContext",
    "TrainingFailedError",
    "WorkerGroupError",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
    "torch",
]


def __getattr__(name: str) -> Any:
    if name == "torch":
        return importlib.import_module("tpuray.train.torch")
    if name == "DataParallelTrainer":
        return importlib.import_module("tpuray.train.trainer").DataParallelTrainer
    raise AttributeError(f"module 'tpuray.train' has no attribute {name!r}")
