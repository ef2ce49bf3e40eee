"""Catalog of TPU generations: chips per host, cores and devices per chip, valid topologies.

Sources (see docs/topology.md): Ray 2.60 `ray/_private/accelerators/tpu.py` (generation spellings,
pod-type naming, chips per host, valid 2D topologies) and the Cloud TPU system-architecture pages
(v4, v5e, v5p, v6e, tpu7x) for pod sizes and 3D shape rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from tpuray.validation import ConfigError

# Multi-host slices of every generation use 4-chip hosts (Ray: DEFAULT_TPU_NUM_CHIPS_PER_HOST).
MULTI_HOST_CHIPS_PER_HOST = 4
# Shapes smaller than one 4x4x4 cube that 3D generations accept (Ray's VALID_TPU_TOPOLOGY).
SMALL_3D_TOPOLOGIES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
# v5e / v6e: Ray's VALID_TPU_TOPOLOGY (includes 2x8, a 16-chip 4-host slice).
TOPOLOGIES_2D = ("1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16")
# v5e / v6e topologies that fit one host, which then holds the whole slice (1, 4 or 8 chips).
SINGLE_HOST_2D = ("1x1", "2x2", "2x4")

_DIM_RE = re.compile(r"^\s*(\d+)(?:\s*x\s*(\d+))(?:\s*x\s*(\d+))?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Generation:
    """One TPU generation. `name` is Ray's spelling, used in pod types ("v5litepod-16")."""

    name: str  # "v4", "v5litepod", "v5p", "v6e", "v7x"
    family: str  # common name: "v5e", "v6e", "v7x"
    aliases: tuple[str, ...]  # extra lower-case spellings accepted by get_generation
    dims: int  # 2 (v5e, v6e) or 3 (v4, v5p, v7x)
    cores_per_chip: int  # TensorCores per chip
    devices_per_chip: int  # devices a framework sees per chip (v7x: 2)
    pod_chips: int  # chips in a full pod
    hbm_gib_per_chip: int
    codename: str = ""  # "Trillium", "Ironwood"

    def __post_init__(self) -> None:
        if self.dims not in (2, 3):
            raise ConfigError(f"dims must be 2 or 3, got {self.dims}")

    def __repr__(self) -> str:
        return f"get_generation({self.accelerator_type!r})"

    @property
    def accelerator_type(self) -> str:
        """Ray's accelerator type: resource `accelerator_type:TPU-V6E`."""
        return f"TPU-{self.name.upper()}"

    def pod_type(self, num_chips: int) -> str:
        """Ray's pod type, e.g. "v6e-16", "v4-16" (2x2x2): the count is TensorCores per slice,
        which equals chips for single-core v5e/v6e (Ray: infer_tpu_pod_type_from_topology)."""
        return f"{self.name}-{num_chips * self.cores_per_chip}"

    def is_valid_shape(self, dims: tuple[int, ...]) -> bool:
        if len(dims) != self.dims:
            return False
        text = "x".join(map(str, dims))
        if self.dims == 2:
            return text in TOPOLOGIES_2D
        if text in SMALL_3D_TOPOLOGIES:
            return True
        chips = dims[0] * dims[1] * dims[2]
        return all(d > 0 and d % 4 == 0 for d in dims) and chips <= self.pod_chips

    def chips_per_host(self, dims: tuple[int, ...]) -> int:
        """v5e/v6e single-host shapes put the whole slice (1, 4 or 8 chips) on one host;
        everything else uses 4-chip hosts (Ray: get_chips_per_host)."""
        text = "x".join(map(str, dims))
        if self.dims == 2 and text in SINGLE_HOST_2D:
            return dims[0] * dims[1]
        return MULTI_HOST_CHIPS_PER_HOST

    def valid_topologies_text(self) -> str:
        """What `topology` may be, for error messages."""
        if self.dims == 2:
            return ", ".join(TOPOLOGIES_2D)
        return (
            f"{', '.join(SMALL_3D_TOPOLOGIES)}, or AxBxC with A, B, C multiples of 4 and at most "
            f"{self.pod_chips} chips (e.g. 4x4x4, 4x4x8, 8x8x8, 8x16x16)"
        )


# v4 / v5p run their two TensorCores as one "megacore" device; v7x exposes each as its own device.
GENERATIONS: tuple[Generation, ...] = (
    Generation(
        name="v4", family="v4", aliases=("v4", "v4-podslice"), dims=3, cores_per_chip=2, devices_per_chip=1,
        pod_chips=4096, hbm_gib_per_chip=32,
    ),
    Generation(
        name="v5litepod", family="v5e", aliases=("v5e", "v5lite", "v5litepod", "v5lite-pod", "v5-lite-podslice", "v5-lite-device"),
        dims=2,
        cores_per_chip=1, devices_per_chip=1, pod_chips=256, hbm_gib_per_chip=16,
    ),
    Generation(
        name="v5p", family="v5p", aliases=("v5p", "v5p-slice"), dims=3, cores_per_chip=2, devices_per_chip=1,
        pod_chips=8960, hbm_gib_per_chip=95,
    ),
    Generation(
        name="v6e", family="v6e", aliases=("v6e", "trillium", "v6e-slice"), dims=2, cores_per_chip=1,
        devices_per_chip=1, pod_chips=256, hbm_gib_per_chip=32, codename="Trillium",
    ),
    Generation(
        name="v7x", family="v7x", aliases=("v7x", "7x", "ironwood"), dims=3, cores_per_chip=2,
        devices_per_chip=2, pod_chips=9216, hbm_gib_per_chip=192, codename="Ironwood",
    ),
)  # fmt: skip

_BY_ALIAS: dict[str, Generation] = {a: g for g in GENERATIONS for a in (g.name, *g.aliases)}


def known_accelerator_types() -> str:
    return ", ".join(g.accelerator_type for g in GENERATIONS)


def get_generation(accelerator_type: str | Generation) -> Generation:
    """Look up a generation by Ray accelerator type or any common spelling, case-insensitive:
    "TPU-V6E", "v6e", "tpu-v6e", "TPU-V5LITEPOD", "v5e", "tpu7x", "TPU-V7X", or a pod type such as
    "v6e-16" / "tpu7x-8" (the count is ignored), or a GKE accelerator label such as "tpu-v6e-slice"
    or "tpu-v5-lite-podslice"."""
    if isinstance(accelerator_type, Generation):
        return accelerator_type
    if not isinstance(accelerator_type, str):
        raise ConfigError(
            f"accelerator_type must be a string, got {accelerator_type!r}; valid: {known_accelerator_types()}"
        )
    gen = _lookup(accelerator_type)
    if gen is None:
        raise ConfigError(
            f"unknown TPU accelerator type {accelerator_type!r}; valid: {known_accelerator_types()} "
            "(or v4, v5e/v5litepod, v5p, v6e, v7x/tpu7x)"
        )
    return gen


@lru_cache(maxsize=256)
def _lookup(spelling: str) -> Generation | None:
    key = spelling.strip().lower()
    key = re.sub(r"-\d+$", "", key)  # pod type "v6e-16" -> "v6e"
    key = re.sub(r"^tpu[-_ ]?", "", key)  # "tpu-v6e", "tpu7x", "TPU-V5LITEPOD"
    return _BY_ALIAS.get(key) or _BY_ALIAS.get(f"v{key}")


def parse_topology(topology: str) -> tuple[int, ...]:
    """Parse "4x4" -> (4, 4) and "2x2x2" -> (2, 2, 2) (dims as written; not validated against a
    generation). Raises ValueError for anything else."""
    if not isinstance(topology, str):
        raise ConfigError(f"topology must be a string like '4x4' or '2x2x2', got {topology!r}")
    m = _DIM_RE.match(topology)
    if not m:
        raise ConfigError(
            f"malformed topology {topology!r}; expected AxB (v5e, v6e) or AxBxC (v4, v5p, v7x), "
            "e.g. '4x4' or '2x2x2'"
        )
    dims = tuple(int(g) for g in m.groups() if g is not None)
    if any(d < 1 for d in dims):
        raise ConfigError(f"malformed topology {topology!r}: every dimension must be >= 1")
    return dims
