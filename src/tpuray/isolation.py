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

from tpuray.topology import SliceTopology, worker_env

logger = logging.getLogger(__name__)

HOST_ENV = ("TPU_NAME", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY")
# Ray's single-process sub-host bounds: they describe an isolated 1-host slice and contradict the
# slice-wide TPU_PROCESS_BOUNDS / TPU_CHIPS_PER_PROCESS_BOUNDS this module sets.
RAY_SUBHOST_BOUNDS = ("TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS")


def host_topology(environ: Mapping[str, str] | None = None) -> SliceTopology:
    """The slice topology of the TPU host this process runs on (from the host env)."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY") if not env.get(k)]
    if missing:
        raise RuntimeError(
            f"not on a TPU host: {', '.join(missing)} unset (expected the GKE/KubeRay TPU host env "
            f"{', '.join(HOST_ENV)}; start an emulated cluster with `tpuray emulate up` to run on CPUs)"
        )
    return SliceTopology.parse(env["TPU_ACCELERATOR_TYPE"], env["TPU_TOPOLOGY"])


def _assigned_chips(env: Mapping[str, str], topo: SliceTopology) -> list[int]:
    visible = env.get("TPU_VISIBLE_CHIPS")
    if visible is None:
        # Ray unsets TPU_VISIBLE_CHIPS when a worker holds every chip of a real host.
        ids = None
        try:
            import ray

            if ray.is_initialized():
                ids = ray.get_runtime_context().get_accelerator_ids().get("TPU")
        except Exception:  # not in a Ray worker
            ids = None
        return sorted(int(i) for i in ids) if ids else list(range(topo.chips_per_host))
    try:
        chips = sorted(int(c) for c in visible.split(",") if c.strip())
    except ValueError:
        raise ValueError(
            f"TPU_VISIBLE_CHIPS={visible!r} is not a comma-separated list of chip indices"
        ) from None
    if not chips:
        raise RuntimeError("TPU_VISIBLE_CHIPS is empty: this process holds no TPU chip")
    return chips


def process_env(environ: Mapping[str, str] | None = None, chips: list[int] | None = None) -> dict[str, str]:
    """Full per-process TPU env for this process (or for `environ`, a host + Ray env mapping).

    `chips` overrides the chips Ray assigned (TPU_VISIBLE_CHIPS). Raises ValueError when the chips do
    not form an aligned share that libtpu can address (e.g. chips 1,2 of a 4-chip host).
    """
    env = os.environ if environ is None else environ
    topo = host_topology(env)
    chips = sorted(chips) if chips is not None else _assigned_chips(env, topo)
    n = len(chips)
    first = chips[0]
    cph = topo.chips_per_host
    aligned = chips == list(range(first, first + n)) and first % n == 0 and cph % n == 0
    if not aligned or chips[-1] >= cph:
        raise ValueError(
            f"chips {chips} are not an aligned share of a {cph}-chip {topo.pod_type} host; valid shares "
            f"are runs of n consecutive chips starting at a multiple of n, with n dividing {cph}"
        )
    worker_id = int(env.get("TPU_WORKER_ID", "0") or 0)
    if not 0 <= worker_id < topo.num_hosts:
        raise ValueError(
            f"TPU_WORKER_ID={worker_id} out of range for {topo.num_hosts} host(s) of {topo.pod_type}"
        )
    hostnames_env = env.get("TPU_WORKER_HOSTNAMES", "")
    hostnames = [h for h in hostnames_env.split(",") if h] or None
    procs_per_host = cph // n
    rank = worker_id * procs_per_host + first // n
    out = worker_env(topo, rank, hostnames=hostnames, chips_per_process=n)
    expected = ",".join(map(str, chips))
    if out["TPU_VISIBLE_CHIPS"] != expected:  # the topology model must agree with Ray's choice
        raise RuntimeError(
            f"topology model maps rank {rank} to chips {out['TPU_VISIBLE_CHIPS']} but Ray assigned {expected}"
        )
    if env.get("TPU_NAME"):
        out["TPU_NAME"] = env["TPU_NAME"]
    return out


def apply_process_env() -> dict[str, str]:
    """Compute `process_env()` and install it in os.environ (dropping Ray's sub-host bounds)."""
    env = process_env()
    for key in RAY_SUBHOST_BOUNDS:
        os.environ.pop(key, None)
    os.environ.update(env)
    logger.debug("TPU process env for chips %s: %s", env["TPU_VISIBLE_CHIPS"], env)
    return env
