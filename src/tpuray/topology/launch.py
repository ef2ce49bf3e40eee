"""What torch_tpu's own launcher derives for one host, from tpuray's per-process env.

torch_tpu 0.2.0's `set_tpu_launch_env()` (`torch.tpu.distributed`, in
`torch_tpu/_internal/distributed/distributed.py`) turns the host env (`TPU_WORKER_HOSTNAMES`,
`TORCH_TPU_TOPOLOGY`, `TORCH_TPU_DEVICES_PER_HOST`, `JOB_COMPLETION_INDEX`) plus the local chip
coordinates into the slice-builder addresses and torchrun's `NNODES`, `NODE_RANK`, `MASTER_ADDR`,
`MASTER_PORT`. tpuray computes all of these itself (`worker_env`, the worker group's torchrun env);
`launcher_inputs` / `launcher_outputs` state, per host, what torch_tpu is given and what tpuray says it
must derive, so tests (and the real-TPU check) can hold the two against each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpuray.constants import (
    CLOUD_TPU_TASK_ID_ENV,
    MASTER_ADDR_ENV,
    NNODES_ENV,
    NODE_RANK_ENV,
    TORCH_TPU_DEVICES_PER_HOST_ENV,
    TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV,
    TORCH_TPU_TOPOLOGY_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_WORKER_ID_ENV,
)
from tpuray.topology.env import worker_envs
from tpuray.topology.slice import Coords, SliceTopology

# The host env torch_tpu's launcher reads (besides the chip coordinates), copied from tpuray's env.
LAUNCHER_INPUTS = (TPU_WORKER_HOSTNAMES_ENV, TORCH_TPU_TOPOLOGY_ENV, TORCH_TPU_DEVICES_PER_HOST_ENV)
# torchrun's rendezvous port when torch_tpu picks it (tpuray's worker group picks a free port instead).
TORCH_TPU_DEFAULT_MASTER_PORT = "29500"


def host_envs(
    topo: SliceTopology, host: int, hostnames: Sequence[str] | None = None, chips_per_process: int = 1
) -> list[dict[str, str]]:
    """tpuray's env of every process on worker `host`, in rank order."""
    envs = worker_envs(topo, hostnames, chips_per_process)
    per_host = len(envs) // topo.num_hosts
    return envs[host * per_host : (host + 1) * per_host]


def host_chip_coords(topo: SliceTopology, host: int) -> Coords:
    """Coordinates of worker `host`'s first chip (what torch_tpu's launcher queries from the device)."""
    return topo.host_chips(host)[0].coords


def launcher_inputs(
    topo: SliceTopology, host: int, hostnames: Sequence[str] | None = None, chips_per_process: int = 1
) -> dict[str, str]:
    """The host env torch_tpu's launcher reads, as tpuray sets it on worker `host`."""
    env = host_envs(topo, host, hostnames, chips_per_process)[0]
    return {k: env[k] for k in LAUNCHER_INPUTS}


def launcher_outputs(
    topo: SliceTopology, host: int, hostnames: Sequence[str] | None = None, chips_per_process: int = 1
) -> dict[str, str]:
    """What torch_tpu's launcher must derive on worker `host` to agree with tpuray: tpuray's slice-builder
    addresses, the host count, this host's node rank (its world ranks' block: rank // ranks per host, the
    same for all its processes) and the host of world rank 0."""
    envs = worker_envs(topo, hostnames, chips_per_process)
    per_host = len(envs) // topo.num_hosts
    mine = [e for e in envs if e[TPU_WORKER_ID_ENV] == str(host)]
    node_ranks = {int(e[CLOUD_TPU_TASK_ID_ENV]) // per_host for e in mine}
    if len(node_ranks) != 1:
        raise AssertionError(f"worker {host}'s processes span node ranks {sorted(node_ranks)}")
    (rank0,) = [e for e in envs if e[CLOUD_TPU_TASK_ID_ENV] == "0"]
    return {
        TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV: rank0[TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV],
        NNODES_ENV: str(topo.num_hosts),
        NODE_RANK_ENV: str(node_ranks.pop()),
        MASTER_ADDR_ENV: rank0[TPU_WORKER_HOSTNAMES_ENV].split(",")[int(rank0[TPU_WORKER_ID_ENV])],
    }
