"""Per-backend distributed setup: the env each worker gets (driver side) and process-group init/teardown
(worker side).

TPU (tpu_dist): RANK/WORLD_SIZE/LOCAL_RANK/... plus TorchTPU's slice-builder + topology env from
`tpuray.topology.worker_env`, and MEGASCALE_* for multi-slice runs. LOCAL_RANK is the chip Ray assigned
(TPU_VISIBLE_CHIPS), because TorchTPU rebinds TPU_VISIBLE_CHIPS from LOCAL_RANK.
GPU (nccl) and CPU (gloo): the standard torchrun variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

MEGASCALE_PORT = 8081


@dataclass(frozen=True)
class RankInfo:
    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    slice_index: int = 0
    slice_rank: int = 0  # rank within its slice (TPU)


def torchrun_env(info: RankInfo, master_addr: str, master_port: int) -> dict[str, str]:
    return {
        "RANK": str(info.world_rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "NODE_RANK": str(info.node_rank),
        "GROUP_RANK": str(info.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def tpu_env(
    info: RankInfo,
    topology,
    hostnames: list[str],
    chips_per_process: int,
    num_slices: int,
    master_addr: str,
) -> dict[str, str]:
    """TorchTPU/libtpu env for one worker of a slice (on top of torchrun_env)."""
    from tpuray.topology import worker_env

    env = dict(
        worker_env(topology, info.slice_rank, hostnames=hostnames, chips_per_process=chips_per_process)
    )
    if num_slices > 1:
        env.update(
            {
                "MEGASCALE_COORDINATOR_ADDRESS": f"{master_addr}:{MEGASCALE_PORT}",
                "MEGASCALE_NUM_SLICES": str(num_slices),
                "MEGASCALE_SLICE_ID": str(info.slice_index),
                "MEGASCALE_PORT": str(MEGASCALE_PORT),
            }
        )
    return env


def device_type_for(backend: str) -> str:
    return {"tpu_dist": "tpu", "nccl": "cuda"}.get(backend, "cpu")


def init_process_group(backend: str, timeout_s: float) -> None:
    """Worker side: create the default process group from the env set above."""
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

    if "tpu_dist" in dist.Backend.backend_list:
        return
    try:
        import tpuray.runtime as runtime

        activate = getattr(runtime, "activate", None)
        if activate is not None:
            activate()
    except ImportError:
        pass
    if "tpu_dist" not in dist.Backend.backend_list:
        raise RuntimeError(
            "backend 'tpu_dist' is not registered in this worker: install torch_tpu on a real TPU host, or "
            "run on an emulated TPU host (TPURAY_EMULATION=1, see tpuray.emulator)"
        )


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
