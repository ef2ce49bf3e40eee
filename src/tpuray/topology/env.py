"""Per-process TPU environment: what libtpu / TorchTPU need to run one process on a share of a host.

Follows torch_xla's `configure_topology` (torch_xla/_internal/tpu.py) for the libtpu variables and
the TorchTPU 0.2.0 `tpu_dist` backend for the TORCH_TPU_* variables (see docs/topology.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tpuray.constants import (
    CLOUD_TPU_TASK_ID_ENV,
    TORCH_TPU_DEVICES_PER_HOST_ENV,
    TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV,
    TORCH_TPU_TOPOLOGY_ENV,
    TPU_ACCELERATOR_TYPE_ENV,
    TPU_CHIPS_PER_PROCESS_BOUNDS_ENV,
    TPU_PROCESS_ADDRESSES_ENV,
    TPU_PROCESS_BOUNDS_ENV,
    TPU_PROCESS_PORT_ENV,
    TPU_TOPOLOGY_ENV,
    TPU_VISIBLE_CHIPS_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_WORKER_ID_ENV,
)
from tpuray.topology.slice import Coords, SliceTopology
from tpuray.validation import ConfigError, check_positive_int, is_int

DEFAULT_PROCESS_PORT = 8476  # libtpu TPU_PROCESS_PORT base (torch_xla's default)
# TorchTPU slice builder base port, + local rank (torch_tpu 0.2.0 set_tpu_launch_env: TORCH_TPU_BASE_PORT's
# default, checked by tests/topology/test_torch_tpu_launch_env.py)
DEFAULT_SLICEBUILDER_PORT = 8070


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def default_hostnames(topo: SliceTopology) -> list[str]:
    """ "localhost" for a single-host slice, otherwise "<pod type>-w<worker id>" (e.g. v6e-16-w3).
    Pass real hostnames (TPU_WORKER_HOSTNAMES of the slice) when you have them."""
    if topo.num_hosts == 1:
        return ["localhost"]
    return [f"{topo.pod_type}-w{i}" for i in range(topo.num_hosts)]


@dataclass(frozen=True)
class _Shared:
    """Environment entries identical for every process of a slice, plus per-host/per-process parts."""

    procs_per_host: int
    num_hosts: int
    # per local process: the common entries plus TPU_VISIBLE_CHIPS and TPU_PROCESS_PORT
    local_envs: tuple[dict[str, str], ...]


def _check_port(name: str, port: int, span: int) -> None:
    if type(port) is not int or not 1 <= port <= 65535 - span:
        raise ConfigError(f"{name}={port!r} out of range; valid: 1..{65535 - span}")


def _build_shared(
    topo: SliceTopology,
    hostnames: tuple[str, ...] | None,
    chips_per_process: int,
    port_base: int,
    slicebuilder_port_base: int,
) -> _Shared:
    share: Coords = topo.share_bounds(chips_per_process)  # ValueError lists valid shares
    hosts = _checked_hostnames(topo, hostnames)
    procs = topo.chips_per_host // chips_per_process
    _check_port("port_base", port_base, procs)
    _check_port("slicebuilder_port_base", slicebuilder_port_base, procs)
    process_bounds, topology_dims = _bounds(topo, share)
    ports = [port_base + p for p in range(procs)]
    sb_ports = [slicebuilder_port_base + p for p in range(procs)]
    # Hosts are listed in worker-id order, which is torch_tpu's topological NODE_RANK order (see
    # tpuray.topology.slice), so torch_tpu's set_tpu_launch_env derives this same address list from
    # TPU_WORKER_HOSTNAMES and TORCH_TPU_DEVICES_PER_HOST: one address per rank, the ranks of a host on
    # consecutive ports. TORCH_TPU_DEVICES_PER_HOST is therefore the ranks per host (tpu_dist also
    # requires LOCAL_RANK < it), not the devices of the host: they differ on v7x and for chip shares.
    common = {
        TPU_CHIPS_PER_PROCESS_BOUNDS_ENV: _csv(share),
        TPU_PROCESS_BOUNDS_ENV: _csv(process_bounds),
        TPU_PROCESS_ADDRESSES_ENV: ",".join(f"{h}:{p}" for h in hosts for p in ports),
        TPU_WORKER_HOSTNAMES_ENV: ",".join(hosts),
        TPU_ACCELERATOR_TYPE_ENV: topo.pod_type,
        TPU_TOPOLOGY_ENV: topo.topology,
        TORCH_TPU_TOPOLOGY_ENV: _csv(topology_dims),
        TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV: ",".join(f"{h}:{p}" for h in hosts for p in sb_ports),
        TORCH_TPU_DEVICES_PER_HOST_ENV: str(procs),
    }
    local_envs = tuple(
        {
            TPU_VISIBLE_CHIPS_ENV: _csv(range(p * chips_per_process, (p + 1) * chips_per_process)),
            TPU_PROCESS_PORT_ENV: str(ports[p]),
            **common,
        }
        for p in range(procs)
    )
    return _Shared(procs, topo.num_hosts, local_envs)


def _checked_hostnames(topo: SliceTopology, hostnames: tuple[str, ...] | None) -> list[str]:
    hosts = list(hostnames) if hostnames is not None else default_hostnames(topo)
    if len(hosts) != topo.num_hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError(
            f"hostnames must list {topo.num_hosts} non-empty host name(s), one per worker of "
            f"{topo.pod_type} ({topo.topology}); got {hostnames!r}"
        )
    return hosts


def _bounds(topo: SliceTopology, share: Coords) -> tuple[list[int], list[int]]:
    """TPU_PROCESS_BOUNDS and TORCH_TPU_TOPOLOGY's dimensions for processes of `share` chips each."""
    per_host = tuple(h // s for h, s in zip(topo.host_shape, share, strict=True))
    process_bounds = [b * p for b, p in zip(topo.host_bounds, per_host, strict=True)]
    topology_dims = list(topo.shape)
    devices = topo.generation.devices_per_chip
    if devices > 1:
        # v7x: each chip is two devices; torch_xla appends it to the process bounds and TorchTPU
        # expects it as a 4th TORCH_TPU_TOPOLOGY dimension (e.g. "1,1,1,2" for one chip).
        process_bounds.append(devices)
        topology_dims.append(devices)
    return process_bounds, topology_dims


@lru_cache(maxsize=16, typed=True)
def _shared_cached(
    topo: SliceTopology,
    hostnames: tuple[str, ...] | None,
    chips_per_process: int,
    port_base: int,
    slicebuilder_port_base: int,
) -> _Shared:
    return _build_shared(topo, hostnames, chips_per_process, port_base, slicebuilder_port_base)


def _env(shared: _Shared, rank: int) -> dict[str, str]:
    host, local = divmod(rank, shared.procs_per_host)
    env = shared.local_envs[local].copy()
    env[TPU_WORKER_ID_ENV] = str(host)
    env[CLOUD_TPU_TASK_ID_ENV] = str(rank)
    return env


def _hosts_key(hostnames: Sequence[str] | None) -> tuple[str, ...] | None:
    if hostnames is None:
        return None
    if isinstance(hostnames, str):
        hostnames = hostnames.split(",")
    return tuple(hostnames)


def num_processes(topo: SliceTopology, chips_per_process: int = 1) -> int:
    """Processes in the slice when each drives `chips_per_process` chips."""
    topo.share_bounds(chips_per_process)
    return topo.num_chips // chips_per_process


def worker_env(
    topo: SliceTopology,
    rank: int,
    hostnames: Sequence[str] | None = None,
    chips_per_process: int = 1,
    port_base: int = DEFAULT_PROCESS_PORT,
    slicebuilder_port_base: int = DEFAULT_SLICEBUILDER_PORT,
) -> dict[str, str]:
    """Environment of process `rank` (0 .. num_chips // chips_per_process - 1) of the slice.

    Process `rank` runs on worker `rank // procs_per_host` and drives local chips
    `[p * chips_per_process, (p + 1) * chips_per_process)` with p = rank % procs_per_host; with one
    chip per process this is exactly `topo.layout()[rank]`. `hostnames` lists one name per worker
    in worker-id order (default: see `default_hostnames`).
    """
    shared = _shared_cached(topo, _hosts_key(hostnames), chips_per_process, port_base, slicebuilder_port_base)
    n = shared.num_hosts * shared.procs_per_host
    if type(rank) is not int or not 0 <= rank < n:
        raise ConfigError(
            f"rank {rank!r} out of range for {n} process(es) of {chips_per_process} chip(s) on "
            f"{topo.pod_type}; valid: 0..{n - 1}"
        )
    return _env(shared, rank)


def worker_envs(
    topo: SliceTopology,
    hostnames: Sequence[str] | None = None,
    chips_per_process: int = 1,
    port_base: int = DEFAULT_PROCESS_PORT,
    slicebuilder_port_base: int = DEFAULT_SLICEBUILDER_PORT,
) -> list[dict[str, str]]:
    """`worker_env` for every process, in rank order. Long shared values (the address lists) are
    the same string objects in every dict."""
    shared = _build_shared(topo, _hosts_key(hostnames), chips_per_process, port_base, slicebuilder_port_base)
    out: list[dict[str, str]] = []
    append = out.append
    rank = 0
    for host in range(shared.num_hosts):
        worker_id = str(host)
        for base in shared.local_envs:
            env = base.copy()
            env[TPU_WORKER_ID_ENV] = worker_id
            env[CLOUD_TPU_TASK_ID_ENV] = str(rank)
            append(env)
            rank += 1
    return out


def multislice_env(
    coordinator_address: str, num_slices: int, slice_id: int, port: int = 8081
) -> dict[str, str]:
    """MEGASCALE_* variables for a multi-slice job (same names and default port as Ray's
    `get_tpu_coordinator_env_vars`)."""
    check_positive_int("num_slices", num_slices)
    if not is_int(slice_id) or not 0 <= slice_id < num_slices:
        raise ConfigError(f"slice_id={slice_id!r} out of range; valid: 0..{num_slices - 1}")
    _check_port("port", port, 0)
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": coordinator_address,
        "MEGASCALE_PORT": str(port),
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
    }
