"""torch.distributed for a worker group: the torchrun env each rank gets and process-group set-up and
teardown inside the worker. One implementation for training and serving.

TPU (tpu_dist): real TorchTPU where it is usable, tpuray's CPU emulation on emulated hosts
(`tpuray.runtime.activate`). GPU (nccl): Ray isolates one GPU per worker (CUDA_VISIBLE_DEVICES).
CPU: gloo. torch is imported only inside the functions that run in workers.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

BACKEND_DEVICE = {"tpu_dist": "tpu", "nccl": "cuda"}


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where one worker sits in its group."""

    world_rank: int
    world_size: int
    local_rank: int  # index among the workers of its host (TPU: its chip share's index there)
    local_world_size: int
    node_rank: int  # index of its host in the group
    slice_index: int = 0  # TPU: which reserved slice
    slice_rank: int = 0  # TPU: rank within its slice (CLOUD_TPU_TASK_ID)


def torchrun_env(rank: RankInfo, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun sets, so `init_process_group(init_method="env://")` works unchanged."""
    return {
        "RANK": str(rank.world_rank),
        "WORLD_SIZE": str(rank.world_size),
        "LOCAL_RANK": str(rank.local_rank),
        "LOCAL_WORLD_SIZE": str(rank.local_world_size),
        "NODE_RANK": str(rank.node_rank),
        "GROUP_RANK": str(rank.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def device_type_for(backend: str) -> str:
    return BACKEND_DEVICE.get(backend, "cpu")


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_process_group(backend: str, timeout_s: float) -> None:
    """Worker side: create the default process group from the env set by `torchrun_env`."""
    import torch
    import torch.distributed as dist

    if backend == "tpu_dist":
        _activate_tpu_runtime()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(0)  # Ray isolates one GPU per worker via CUDA_VISIBLE_DEVICES
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )


def _activate_tpu_runtime() -> None:
    """Make sure the "tpu" device and "tpu_dist" backend exist (real TorchTPU or tpuray's emulation)."""
    import torch.distributed as dist

    from tpuray import runtime
    from tpuray.constants import EMULATION_ENV

    if "tpu_dist" not in dist.Backend.backend_list:
        runtime.activate()
    if "tpu_dist" not in dist.Backend.backend_list:
        raise RuntimeError(
            "backend 'tpu_dist' is not registered in this worker: install torch_tpu on a real TPU host, or "
            f"run on an emulated TPU host ({EMULATION_ENV}=1, see tpuray.emulator)"
        )


def destroy_process_group() -> None:
    """Worker side: destroy the default process group if there is one (idempotent)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
