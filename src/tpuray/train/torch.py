"""`tpuray.train.torch`: drop-in for `ray.train.torch` (TorchTrainer, get_device, prepare_model,
prepare_data_loader), built on Ray Core actors and plain torch.distributed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from tpuray.train.config import TorchConfig
from tpuray.train.devices import get_device, get_devices
from tpuray.train.session import current_session
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.torch_trainer import TorchTrainer

__all__ = [
    "TorchConfig",
    "TorchTrainer",
    "get_device",
    "get_devices",
    "prepare_data_loader",
    "prepare_model",
]


def __getattr__(name: str) -> Any:
    """`TorchTrainer` loads the trainer (and Ray) on first use: the worker-side helpers below import
    neither, so they run where Ray is absent (a TPU VM's single process)."""
    if name == "TorchTrainer":
        from tpuray.train.torch_trainer import TorchTrainer

        return TorchTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _world_size() -> int:
    sess = current_session()
    return sess.context.world_size if sess is not None else 1


def _world_rank() -> int:
    sess = current_session()
    return sess.context.world_rank if sess is not None else 0


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move the model to this worker's device and wrap it in DistributedDataParallel (or FSDP) over the
    active process group when world_size > 1."""
    if parallel_strategy not in ("ddp", "fsdp", None):
        raise ConfigError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) is invalid; valid: 'ddp', 'fsdp', None"
        )
    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy is None or _world_size() <= 1:
        return model
    kwargs = dict(parallel_strategy_kwargs or {})
    if parallel_strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, **kwargs)
    from torch.nn.parallel import DistributedDataParallel

    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device])
        kwargs.setdefault("output_device", device)
    # On the emulated tpu device DDP's time-stats warning is off process-wide (tpuray.runtime.ddp).
    return DistributedDataParallel(model, **kwargs)


def prepare_data_loader(
    data_loader: DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> DataLoader | _DeviceDataLoader:
    """Shard the loader across workers with a DistributedSampler and move each batch to the device.

    auto_transfer (with move_to_device): move the next batch to the device on a background thread while
    the current one is used, as Ray Train overlaps host-to-device copies; False moves each batch when it
    is asked for."""
    world = _world_size()
    if (
        add_dist_sampler
        and world > 1
        and not isinstance(data_loader.dataset, IterableDataset)
        and not isinstance(data_loader.sampler, DistributedSampler)
        and data_loader.batch_size is not None
    ):
        sampler: DistributedSampler = DistributedSampler(
            data_loader.dataset,
            num_replicas=world,
            rank=_world_rank(),
            shuffle=isinstance(data_loader.sampler, RandomSampler),
        )
        data_loader = DataLoader(
            data_loader.dataset,
            batch_size=data_loader.batch_size,
            sampler=sampler,
            num_workers=data_loader.num_workers,
            collate_fn=data_loader.collate_fn,
            pin_memory=data_loader.pin_memory,
            drop_last=data_loader.drop_last,
            timeout=data_loader.timeout,
            worker_init_fn=data_loader.worker_init_fn,
            multiprocessing_context=data_loader.multiprocessing_context,
            prefetch_factor=data_loader.prefetch_factor if data_loader.num_workers > 0 else None,
            persistent_workers=data_loader.persistent_workers,
        )
    if move_to_device:
        return _DeviceDataLoader(data_loader, get_device(), prefetch=auto_transfer)
    return data_loader


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch


class _DeviceDataLoader:
    """Iterates the wrapped DataLoader and moves every batch to `device`; other attributes (sampler,
    dataset, batch_size...) come from the wrapped loader, so `loader.sampler.set_epoch(e)` works."""

    def __init__(self, loader: DataLoader, device: torch.device, prefetch: bool = True) -> None:
        self._loader = loader
        self.device = device
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[Any]:
        if not self.prefetch:
            for batch in self._loader:
                yield _to_device(batch, self.device)
            return
        from concurrent.futures import ThreadPoolExecutor

        batches = iter(self._loader)
        end = object()

        def next_on_device() -> Any:
            batch = next(batches, end)
            return batch if batch is end else _to_device(batch, self.device)

        with ThreadPoolExecutor(1, thread_name_prefix="tpuray-prefetch") as pool:
            pending = pool.submit(next_on_device)
            while True:
                batch = pending.result()
                if batch is end:
                    return
                pending = pool.submit(next_on_device)  # the next copy overlaps the caller's step
                yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
