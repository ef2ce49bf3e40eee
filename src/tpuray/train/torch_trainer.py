"""`tpuray.train.torch.TorchTrainer` (kept apart from the worker-side helpers in torch.py, which must
import without Ray)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpuray.train.checkpoint import Checkpoint
from tpuray.train.config import RunConfig, ScalingConfig, TorchConfig
from tpuray.train.data import DataConfig
from tpuray.train.trainer import DataParallelTrainer


class TorchTrainer(DataParallelTrainer):
    """Runs `train_loop_per_worker(train_loop_config)` on `scaling_config.num_workers` workers with
    torch.distributed initialised (tpu_dist on TPU slices, nccl on GPUs, gloo on CPUs)."""

    def __init__(
        self,
        train_loop_per_worker: Callable,
        *,
        train_loop_config: dict | None = None,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
        datasets: dict | None = None,
        dataset_config: DataConfig | None = None,
    ) -> None:
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            scaling_config=scaling_config,
            run_config=run_config,
            torch_config=torch_config,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
            datasets=datasets,
            dataset_config=dataset_config,
        )
