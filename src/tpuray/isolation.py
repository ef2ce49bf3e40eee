"""Per-chip process isolation: the full libtpu / TorchTPU environment of one process on a TPU host.

Inside a Ray task or actor holding `resources={"TPU": n}`, Ray has already chosen the chips and set
TPU_VISIBLE_CHIPS (plus TPU_CHIPS_PER_HOST_BOUNDS / TPU_HOST_BOUNDS for 1-2 chip shares). The host env
(TPU_NAME, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, set by GKE/KubeRay or
by the emulator) says where this host sits in its slice. `process_env()` combines both through
`tpuray.topology.worker_env` into the slice-wide per-process env, keeping the chips Ray assigned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from tpuray.constants import (
    HOST_ENV,
    RAY_SUBHOST_BOUNDS_ENV,
    TPU_ACCELERATOR_TYPE_ENV,
    TPU_NAME_ENV,
    TPU_RESOURCE,
    TPU_TOPOLOGY_ENV,
    TPU_VISIBLE_CHIPS_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_WORKER_ID_ENV,
)
from tpuray.topology import SliceTopology, worker_env

logger = logging.getLogger(__name__)


def host_topology(environ: Mapping[str, str] | None = None) -> SliceTopology:
    """The slice topology of the TPU host this process runs on (from the host env)."""
    env = os.environ if environ is None else environ
    missing = [k for k in (TPU_ACCELERATOR_TYPE_ENV, TPU_TOPOLOGY_ENV) if not env.get(k)]
    if missing:
        raise RuntimeError(
            f"not on a TPU host: {', '.join(missing)} unset (expected the GKE/KubeRay TPU host env "
            f"{', '.join(HOST_ENV)}; start an emulated cluster with `tpuray emulate up` to run on CPUs)"
        )
    return SliceTopology.parse(env[TPU_ACCELERATOR_TYPE_ENV], env[TPU_TOPOLOGY_ENV])


def host_worker_id(environ: Mapping[str, str], topo: SliceTopology) -> int:
    """This host's worker id in its slice (TPU_WORKER_ID; 0 on a single-host slice without it)."""
    raw = environ.get(TPU_WORKER_ID_ENV, "0") or "0"
    try:
        worker_id = int(raw)
    except ValueError:
        raise ValueError(f"{TPU_WORKER_ID_ENV}={raw!r} is not an integer") from None
    if not 0 <= worker_id < topo.num_hosts:
        raise ValueError(
            f"{TPU_WORKER_ID_ENV}={worker_id} out of range for {topo.num_hosts} host(s) of {topo.pod_type}"
        )
    return worker_id


def slice_hostnames(
    environ: Mapping[str, str], topo: SliceTopology, node_ips: list[str] | None = None
) -> list[str] | None:
    """The one hostname rule: the slice's TPU_WORKER_HOSTNAMES (set by GKE/KubeRay and the emulator),
    else the Ray node IPs of its hosts in worker-id order when known, else None (topology defaults)."""
    listed = [h for h in environ.get(TPU_WORKER_HOSTNAMES_ENV, "").split(",") if h]
    if len(listed) == topo.num_hosts:
        return listed
    return list(node_ips) if node_ips else None


def _assigned_chips(env: Mapping[str, str], topo: SliceTopology) -> list[int]:
    visible = env.get(TPU_VISIBLE_CHIPS_ENV)
    if visible is None:
        # Ray unsets TPU_VISIBLE_CHIPS when a worker holds every chip of a real host.
        ids = None
        try:
            import ray

            if ray.is_initialized():
                ids = ray.get_runtime_context().get_accelerator_ids().get(TPU_RESOURCE)
        except Exception:  # not in a Ray worker
            ids = None
        return sorted(int(i) for i in ids) if ids else list(range(topo.chips_per_host))
    try:
        chips = sorted(int(c) for c in visible.split(",") if c.strip())
    except ValueError:
        raise ValueError(
            f"{TPU_VISIBLE_CHIPS_ENV}={visible!r} is not a comma-separated list of chip indices"
        ) from None
    if not chips:
        raise RuntimeError(f"{TPU_VISIBLE_CHIPS_ENV} is empty: this process holds no TPU chip")
    return chips


def process_env(
    environ: Mapping[str, str] | None = None,
    chips: list[int] | None = None,
    hostnames: list[str] | None = None,
) -> dict[str, str]:
    """Full per-process TPU env for this process (or for `environ`, a host + Ray env mapping).

    `chips` overrides the chips Ray assigned (TPU_VISIBLE_CHIPS); `hostnames` the slice's host names
    (default: `slice_hostnames`). The process's slice rank (CLOUD_TPU_TASK_ID) is
    worker id x processes per host + its share's index on the host. Raises ValueError when the chips
    do not form an aligned share that libtpu can address (e.g. chips 1,2 of a 4-chip host).
    """
    env = os.environ if environ is None else environ
    topo = host_topology(env)
    chips = sorted(chips) if chips is not None else _assigned_chips(env, topo)
    local = topo.local_process(chips)  # the one chip-share rule (ValueError names the chips)
    n = len(chips)
    worker_id = host_worker_id(env, topo)
    rank = worker_id * (topo.chips_per_host // n) + local
    names = hostnames if hostnames is not None else slice_hostnames(env, topo)
    out = worker_env(topo, rank, hostnames=names, chips_per_process=n)
    expected = ",".join(map(str, chips))
    if out[TPU_VISIBLE_CHIPS_ENV] != expected:  # the topology model must agree with Ray's choice
        raise RuntimeError(
            f"topology model maps rank {rank} to chips {out[TPU_VISIBLE_CHIPS_ENV]} but Ray assigned {expected}"
        )
    if env.get(TPU_NAME_ENV):
        out[TPU_NAME_ENV] = env[TPU_NAME_ENV]
    return out


def apply_process_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Install `env` (default: `process_env()`) in os.environ, dropping Ray's sub-host bounds first (they
    describe an isolated 1-host slice, not the slice `env` places this process in). The one rule for
    every worker process (`tpuray.slices.SliceWorker.setup_distributed` installs its rank's env here)."""
    env = dict(process_env() if env is None else env)
    for key in RAY_SUBHOST_BOUNDS_ENV:
        os.environ.pop(key, None)
    os.environ.update(env)
    logger.debug("TPU process env for chips %s: %s", env.get(TPU_VISIBLE_CHIPS_ENV), env)
    return env
