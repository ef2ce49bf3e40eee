"""One TPU slice: shape, hosts, per-chip ICI coordinates and the rank layout.

Conventions (see docs/topology.md):
- Coordinates follow the topology string: "AxBxC" -> coords (a, b, c) with 0 <= a < A, ...;
  2D topologies are padded with a trailing 1 ("4x4" -> shape (4, 4, 1)).
- Multi-host slices are cut into 2x2x1 blocks of 4 chips, one block per host. Hosts are numbered
  (worker id) over the host grid with the first dimension fastest (Z-major, X-minor): torch_tpu
  0.2.0's topological NODE_RANK (`_get_slice_host_coordinates` in
  torch_tpu/_internal/distributed/distributed.py) and Ray 2.60's `_get_physical_worker_id_from_coords`
  (x = the first chip coordinate, fastest) both order hosts this way.
- Inside a host, local chip i (= TPU_VISIBLE_CHIPS index = LOCAL_RANK) is also row-major, last
  dimension fastest, so a 2-chip share is a 1x2x1 block (Ray's TPU_CHIPS_PER_HOST_BOUNDS "1,2,1").
- rank = host * chips_per_host + local_chip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from tpuray.constants import head_resource
from tpuray.topology.catalog import Generation, get_generation, parse_topology
from tpuray.validation import ConfigError

Coords = tuple[int, int, int]

# Chips a single process may drive (Ray: TPU_VALID_CHIP_OPTIONS).
PROCESS_SHARES = (1, 2, 4, 8)


class ChipPlacement(NamedTuple):
    """Where rank `rank` runs: worker `host`, chip `local_chip` there, ICI coordinates `coords`."""

    rank: int
    host: int
    local_chip: int
    coords: Coords


def _row_major(index: int, bounds: Coords) -> Coords:
    """Index -> coordinates in a grid of `bounds`, last dimension fastest."""
    _, b1, b2 = bounds
    return (index // (b1 * b2), (index // b2) % b1, index % b2)


def _host_major(index: int, bounds: Coords) -> Coords:
    """Host index -> host grid coordinates, first dimension fastest (torch_tpu's NODE_RANK order)."""
    b0, b1, _ = bounds
    return (index % b0, (index // b0) % b1, index // (b0 * b1))


def _host_index(host: Coords, bounds: Coords) -> int:
    """Inverse of `_host_major`."""
    b0, b1, _ = bounds
    return (host[2] * b1 + host[1]) * b0 + host[0]


def _share_bounds(share: int, host_shape: Coords) -> Coords | None:
    """Bounds of `share` consecutive (row-major) chips of a host, or None if they are not a block
    that tiles the host."""
    rem, bounds = share, [1, 1, 1]
    for d in (2, 1, 0):
        size = host_shape[d]
        if rem >= size:
            if rem % size:
                return None
            bounds[d], rem = size, rem // size
        else:
            if size % rem:
                return None
            bounds[d], rem = rem, 1
    return (bounds[0], bounds[1], bounds[2]) if rem == 1 else None


@dataclass(frozen=True)
class SliceTopology:
    """A TPU slice of one generation and shape. Build it with `SliceTopology.parse`."""

    generation: Generation
    shape: Coords  # padded to 3 dims: "4x4" -> (4, 4, 1)
    topology: str = field(default="")  # canonical string, derived from shape: "4x4", "2x2x2"

    def __post_init__(self) -> None:
        object.__setattr__(self, "generation", get_generation(self.generation))
        object.__setattr__(self, "shape", tuple(self.shape))
        dims = self.shape[: self.generation.dims]
        text = "x".join(map(str, dims))
        if len(self.shape) != 3 or not self.generation.is_valid_shape(dims):
            raise ConfigError(
                f"topology {text!r} is not valid for {self.generation.family}; "
                f"valid: {self.generation.valid_topologies_text()}"
            )
        if self.generation.dims == 2 and self.shape[2] != 1:
            raise ConfigError(f"2D topology {text!r} must have shape (A, B, 1), got {self.shape}")
        object.__setattr__(self, "topology", text)

    @classmethod
    def parse(cls, accelerator_type: str | Generation, topology: str) -> SliceTopology:
        """`SliceTopology.parse("TPU-V6E", "4x4")`. ValueError names the bad value and what is valid."""
        gen = get_generation(accelerator_type)
        dims = parse_topology(topology)
        text = "x".join(map(str, dims))
        if len(dims) != gen.dims or not gen.is_valid_shape(dims):
            kind = "AxB" if gen.dims == 2 else "AxBxC"
            raise ConfigError(
                f"topology {topology!r} is not valid for {gen.family} ({kind}); "
                f"valid: {gen.valid_topologies_text()}"
            )
        shape = (dims + (1,))[:3] if gen.dims == 2 else dims
        return cls(gen, (shape[0], shape[1], shape[2]), text)

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def accelerator_type(self) -> str:
        return self.generation.accelerator_type

    @cached_property
    def num_chips(self) -> int:
        a, b, c = self.shape
        return a * b * c

    @property
    def num_devices(self) -> int:
        return self.num_chips * self.generation.devices_per_chip

    @cached_property
    def chips_per_host(self) -> int:
        return self.generation.chips_per_host(self.shape[: self.generation.dims])

    @cached_property
    def num_hosts(self) -> int:
        return self.num_chips // self.chips_per_host

    @cached_property
    def host_shape(self) -> Coords:
        """Chips-per-host bounds: (2, 2, 1) for 4-chip hosts, the whole shape on a single host."""
        return self.shape if self.num_hosts == 1 else (2, 2, 1)

    @cached_property
    def host_bounds(self) -> Coords:
        """The grid of hosts: shape // host_shape per dimension."""
        (a, b, c), (x, y, z) = self.shape, self.host_shape
        return (a // x, b // y, c // z)

    @cached_property
    def pod_type(self) -> str:
        """Ray's pod type: "v6e-16" (chips for v5e/v6e), "v4-16" for 2x2x2 (TensorCores)."""
        return self.generation.pod_type(self.num_chips)

    @property
    def head_resource(self) -> str:
        """Ray's custom resource on worker 0 of the slice: "TPU-v6e-16-head"."""
        return head_resource(self.pod_type)

    @property
    def wraparound(self) -> tuple[bool, bool, bool]:
        """Which dimensions have ICI wraparound links (torus). 3D generations: slices made of whole
        4x4x4 cubes are full tori; v5e/v6e: only the full 16x16 pod."""
        if self.generation.dims == 3:
            torus = all(d % 4 == 0 for d in self.shape)
        else:
            torus = self.shape[:2] == (16, 16)
        return tuple(torus and d > 2 for d in self.shape)  # type: ignore[return-value]

    def process_shares(self) -> tuple[int, ...]:
        """Valid `chips_per_process` values: 1, 2, 4 or 8 chips that form a block tiling a host."""
        cph, hs = self.chips_per_host, self.host_shape
        return tuple(s for s in PROCESS_SHARES if s <= cph and _share_bounds(s, hs) is not None)

    def local_process(self, chips: Sequence[int]) -> int:
        """Index, on its host, of the process driving local `chips` (the chips Ray assigned it).

        The one rule for chip shares: n chips, n one of `process_shares()`, consecutive and starting at a
        multiple of n. ValueError otherwise (e.g. chips 1,2 of a 4-chip host: libtpu cannot address them).
        """
        chips = sorted(chips)
        n = len(chips)
        if not chips or n not in self.process_shares():
            valid = ", ".join(map(str, self.process_shares()))
            raise ValueError(
                f"chips {chips} are not a valid share of a {self.chips_per_host}-chip {self.pod_type} host; "
                f"a process drives {valid} chip(s)"
            )
        first = chips[0]
        if chips != list(range(first, first + n)) or first % n or chips[-1] >= self.chips_per_host:
            raise ValueError(
                f"chips {chips} are not an aligned share of a {self.chips_per_host}-chip {self.pod_type} "
                f"host; valid {n}-chip shares are runs of {n} consecutive chips starting at a multiple of {n}"
            )
        return first // n

    def share_bounds(self, chips_per_process: int) -> Coords:
        """Bounds of the chip block one process drives (TPU_CHIPS_PER_PROCESS_BOUNDS)."""
        bounds = None
        share = chips_per_process
        if type(share) is int and share in PROCESS_SHARES and share <= self.chips_per_host:
            bounds = _share_bounds(chips_per_process, self.host_shape)
        if bounds is None:
            valid = ", ".join(map(str, self.process_shares()))
            raise ConfigError(
                f"chips_per_process={chips_per_process!r} does not tile a {self.chips_per_host}-chip "
                f"host of {self.pod_type} ({self.topology}); valid: {valid}"
            )
        return bounds

    # ---- coordinates and layout ----------------------------------------------------------------

    def host_coords(self, host: int) -> Coords:
        """Position of worker `host` in the host grid (first dimension fastest)."""
        self._check("host", host, self.num_hosts)
        return _host_major(host, self.host_bounds)

    def placement(self, rank: int) -> ChipPlacement:
        self._check("rank", rank, self.num_chips)
        host, local = divmod(rank, self.chips_per_host)
        hx, hy, hz = _host_major(host, self.host_bounds)
        sx, sy, sz = self.host_shape
        lx, ly, lz = _row_major(local, self.host_shape)
        return ChipPlacement(rank, host, local, (hx * sx + lx, hy * sy + ly, hz * sz + lz))

    def rank_of(self, coords: Coords) -> int:
        """Inverse of the layout: the rank driving the chip at `coords`."""
        coords = tuple(coords)  # type: ignore[assignment]
        if len(coords) != 3 or any(not 0 <= c < s for c, s in zip(coords, self.shape, strict=True)):
            raise ConfigError(f"coords {coords!r} outside slice shape {self.shape}")
        (x, y, z), (sx, sy, sz) = coords, self.host_shape
        host = _host_index((x // sx, y // sy, z // sz), self.host_bounds)
        local = ((x % sx) * sy + y % sy) * sz + z % sz
        return host * self.chips_per_host + local

    @cached_property
    def _layout(self) -> tuple[ChipPlacement, ...]:
        sx, sy, sz = self.host_shape
        cph, bounds = self.chips_per_host, self.host_bounds
        offsets = [_row_major(i, self.host_shape) for i in range(cph)]
        make = tuple.__new__  # ChipPlacement(...) without the keyword-handling __new__
        out: list[ChipPlacement] = []
        extend = out.extend
        for host in range(self.num_hosts):
            hx, hy, hz = _host_major(host, bounds)
            ox, oy, oz = hx * sx, hy * sy, hz * sz
            base = host * cph
            extend(
                make(ChipPlacement, (base + i, host, i, (ox + lx, oy + ly, oz + lz)))
                for i, (lx, ly, lz) in enumerate(offsets)
            )
        return tuple(out)

    def layout(self) -> list[ChipPlacement]:
        """Every chip's placement, ordered by rank (rank r is `layout()[r]`)."""
        return list(self._layout)

    def host_chips(self, host: int) -> list[ChipPlacement]:
        self._check("host", host, self.num_hosts)
        cph = self.chips_per_host
        return list(self._layout[host * cph : (host + 1) * cph])

    def ici_neighbors(self, coords: Coords) -> list[Coords]:
        """Chips one ICI hop away from `coords` (wraparound links included where present)."""
        out: list[Coords] = []
        for d, size in enumerate(self.shape):
            if size == 1:
                continue
            for step in (-1, 1):
                c = list(coords)
                c[d] += step
                if not 0 <= c[d] < size:
                    if not self.wraparound[d]:
                        continue
                    c[d] %= size
                t = (c[0], c[1], c[2])
                if t != tuple(coords) and t not in out:
                    out.append(t)
        return out

    def are_ici_neighbors(self, a: Coords, b: Coords) -> bool:
        return tuple(b) in self.ici_neighbors(a)

    def describe(self) -> str:
        return (
            f"{self.generation.family} {self.topology}: {self.num_chips} chips on {self.num_hosts} "
            f"host(s) of {self.chips_per_host} ({self.pod_type})"
        )

    def __str__(self) -> str:
        return f"{self.pod_type} ({self.topology})"

    def __repr__(self) -> str:
        return f"SliceTopology.parse({self.accelerator_type!r}, {self.topology!r})"

    @staticmethod
    def _check(what: str, value: int, n: int) -> None:
        if type(value) is not int or not 0 <= value < n:
            raise ConfigError(f"{what} {value!r} out of range; valid: 0..{n - 1}")
