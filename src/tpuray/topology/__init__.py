"""TPU topology model: generations, slice shapes, hosts, ICI coordinates, rank layout and the
per-process environment. Pure Python (no torch, no ray).

    >>> from tpuray.topology import SliceTopology, worker_env
    >>> topo = SliceTopology.parse("TPU-V6E", "4x4")
    >>> topo.num_hosts, topo.host_shape, topo.pod_type
    (4, (2, 2, 1), 'v6e-16')
"""

from tpuray.topology.catalog import (
    GENERATIONS,
    Generation,
    get_generation,
    known_accelerator_types,
    parse_topology,
)
from tpuray.topology.env import (
    DEFAULT_PROCESS_PORT,
    DEFAULT_SLICEBUILDER_PORT,
    default_hostnames,
    multislice_env,
    num_processes,
    worker_env,
    worker_envs,
)
from tpuray.topology.slice import PROCESS_SHARES, ChipPlacement, Coords, SliceTopology

__all__ = [
    "DEFAULT_PROCESS_PORT",
    "DEFAULT_SLICEBUILDER_PORT",
    "GENERATIONS",
    "PROCESS_SHARES",
    "ChipPlacement",
    "Coords",
    "Generation",
    "SliceTopology",
    "default_hostnames",
    "get_generation",
    "known_accelerator_types",
    "multislice_env",
    "num_processes",
    "parse_topology",
    "worker_env",
    "worker_envs",
]
