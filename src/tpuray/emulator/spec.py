"""What an emulated TPU cluster is made of: slice requests and the per-host node specs.

Pure Python (no ray import): the node specs are plain resources, labels and env, exactly what Ray would
detect on a real GKE/KubeRay TPU host, plus the markers that say the host is emulated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

from tpuray.constants import (
    ACCELERATOR_LABEL,
    EMULATED_LABEL,
    EMULATION_ENV,
    POD_TYPE_LABEL,
    SLICE_NAME_LABEL,
    TOPOLOGY_LABEL,
    TPU_ACCELERATOR_TYPE_ENV,
    TPU_NAME_ENV,
    TPU_RESOURCE,
    TPU_TOPOLOGY_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_WORKER_ID_ENV,
    WORKER_ID_LABEL,
    accelerator_resource,
)
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError, check_positive_int

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")

SliceCores = Literal["shared", "per_slice"]
"""Where the emulated hosts' processes (raylets and the workers they start) compute:

- "shared": on every core this process may use, all slices together (Ray's default);
- "per_slice": each slice started by hand on cores of its own (`split_cores`), as a real slice computes on
  its own chips: work on two slices at once (a trainer and a rollout engine) does not slow each other the
  way it does on shared cores. The head (drivers, Serve) keeps every core."""
SLICE_CORES: tuple[SliceCores, ...] = get_args(SliceCores)


@dataclass(frozen=True)
class SliceRequest:
    """`count` emulated slices of one accelerator type and topology, e.g. SliceRequest("TPU-V6E", "2x2")."""

    accelerator_type: str
    topology: str
    count: int = 1

    def __post_init__(self) -> None:
        check_positive_int("SliceRequest.count", self.count)
        SliceTopology.parse(self.accelerator_type, self.topology)  # ValueError naming what is valid

    @property
    def slice_topology(self) -> SliceTopology:
        return SliceTopology.parse(self.accelerator_type, self.topology)

    def key(self) -> tuple[str, tuple[int, int, int], int]:
        """Canonical identity (so "v6e"/"TPU-V6E" and "4x4"/"4x4x1" compare equal)."""
        topo = self.slice_topology
        return (topo.generation.accelerator_type, topo.shape, self.count)


@dataclass(frozen=True)
class HostSpec:
    """One emulated TPU host = one Ray node."""

    slice_name: str
    worker_id: int
    num_cpus: int
    memory: int
    resources: dict[str, float]
    labels: dict[str, str]
    env: dict[str, str]

    @property
    def node_name(self) -> str:
        return f"emulated-tpu-host-{self.slice_name}-w{self.worker_id}"


@dataclass
class EmulatedSlice:
    """One emulated slice: its name (TPU_NAME), topology, and the Ray nodes of its hosts (by worker id)."""

    name: str
    topology: SliceTopology
    hostnames: list[str]
    node_ids: list[str] = field(default_factory=list)
    hosts: list[HostSpec] = field(default_factory=list, repr=False)
    cores: tuple[int, ...] = ()  # the cores its hosts' processes run on (cores="per_slice"); (): shared

    @property
    def emulated(self) -> bool:
        return True

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"EmulatedSlice(name={self.name!r}, {t.generation.accelerator_type} {t.topology}, "
            f"hosts={t.num_hosts}, chips_per_host={t.chips_per_host}, node_ids={self.node_ids!r}, "
            f"{f'cores={self.cores}, ' if self.cores else ''}emulated)"
        )


def host_specs(
    topo: SliceTopology,
    slice_name: str,
    hostname: str,
    cpus_per_chip: int = 2,
    host_memory_bytes: int = 4 * 1024**3,
) -> list[HostSpec]:
    """Node specs for every host of one emulated slice, ordered by worker id."""
    if not _NAME_RE.match(slice_name):
        raise ConfigError(
            f"slice name {slice_name!r} must be lowercase letters, digits and '-' (at most 42 characters)"
        )
    accel = topo.generation.accelerator_type
    hostnames = ",".join([hostname] * topo.num_hosts)
    specs = []
    for worker_id in range(topo.num_hosts):
        resources: dict[str, float] = {
            TPU_RESOURCE: float(topo.chips_per_host),
            slice_name: 1.0,
            accelerator_resource(accel): 1.0,
        }
        if worker_id == 0:
            resources[topo.head_resource] = 1.0
        labels, env = _host_identity(topo, slice_name, worker_id, hostnames)
        specs.append(
            HostSpec(
                slice_name=slice_name,
                worker_id=worker_id,
                num_cpus=cpus_per_chip * topo.chips_per_host,
                memory=host_memory_bytes,
                resources=resources,
                labels=labels,
                env=env,
            )
        )
    return specs


def _host_identity(
    topo: SliceTopology, slice_name: str, worker_id: int, hostnames: str
) -> tuple[dict[str, str], dict[str, str]]:
    """The node labels and the environment of one host, as GKE and Ray give a real TPU host."""
    accel = topo.generation.accelerator_type
    labels = {
        SLICE_NAME_LABEL: slice_name,
        WORKER_ID_LABEL: str(worker_id),
        TOPOLOGY_LABEL: topo.topology,
        POD_TYPE_LABEL: topo.pod_type,
        ACCELERATOR_LABEL: accel,
        EMULATED_LABEL: "true",
    }
    env = {
        TPU_NAME_ENV: slice_name,
        TPU_WORKER_ID_ENV: str(worker_id),
        TPU_WORKER_HOSTNAMES_ENV: hostnames,
        # GKE sets the pod type here ("v6e-16"); Ray derives accelerator_type and labels from it.
        TPU_ACCELERATOR_TYPE_ENV: topo.pod_type,
        TPU_TOPOLOGY_ENV: topo.topology,
        EMULATION_ENV: "1",
    }
    return labels, env


def plan_slices(
    requests: list[SliceRequest],
    hostname: str,
    name_prefix: str = "emulated",
    cpus_per_chip: int = 2,
    host_memory_bytes: int = 4 * 1024**3,
) -> list[EmulatedSlice]:
    """Name every requested slice (`<prefix>-<pod type>-<i>`) and lay out its hosts."""
    if not requests:
        raise ConfigError("an emulated cluster needs at least one SliceRequest, got none")
    check_positive_int("cpus_per_chip", cpus_per_chip)
    slices: list[EmulatedSlice] = []
    index: dict[str, int] = {}
    for req in requests:
        if not isinstance(req, SliceRequest):
            raise TypeError(f"expected SliceRequest, got {type(req).__name__}: {req!r}")
        topo = req.slice_topology
        for _ in range(req.count):
            i = index.get(topo.pod_type, 0)
            index[topo.pod_type] = i + 1
            name = f"{name_prefix}-{topo.pod_type}-{i}"
            hosts = host_specs(topo, name, hostname, cpus_per_chip, host_memory_bytes)
            slices.append(EmulatedSlice(name, topo, [hostname] * topo.num_hosts, hosts=hosts))
    return slices


def split_cores(count: int, usable: Iterable[int]) -> list[tuple[int, ...]]:
    """`count` disjoint sets of equally many of the `usable` cores, in order: one per slice
    (cores="per_slice"); the cores left over where they do not divide evenly serve the head alone.
    ConfigError where there are fewer cores than slices."""
    cores = sorted(usable)
    if count > len(cores):
        raise ConfigError(
            f"cores='per_slice' gives each of the {count} slices cores of its own; this process may use "
            f"{len(cores)} core(s) {cores}: start at most {len(cores)} slice(s), or use cores='shared'"
        )
    per = len(cores) // count
    return [tuple(cores[i * per : (i + 1) * per]) for i in range(count)]
