"""`SliceWorkerGroup`: the one per-chip worker group behind training and serving.

It reserves the hardware (TPU: whole slices through `SlicePlacementGroup`, one bundle per chip share,
slice-major by worker id; CPU/GPU: a plain placement group, one bundle per worker), starts one actor per
bundle, ranks the actors by slice position, computes each rank's process env, initialises and destroys
the process group, and tears everything down on every path.

Rules, each in one place:
- rank (TPU): slice index x workers per slice + slice rank, where the slice rank is
  `tpuray.isolation.process_env`'s CLOUD_TPU_TASK_ID: host worker id x shares per host + the index of
  the chip share Ray assigned (so LOCAL_RANK == the share's index on its host, TPU_VISIBLE_CHIPS kept);
  CPU/GPU: grouped by node, in bundle order.
- host names: `tpuray.isolation.slice_hostnames` (TPU_WORKER_HOSTNAMES, else the hosts' node IPs).
- master: rank 0's node IP and a port free there (`tpuray.slices.distributed.free_port`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tpuray.constants import (
    CLOUD_TPU_TASK_ID_ENV,
    PLACEMENT_STRATEGIES,
    TPU_ACCELERATOR_TYPE_ENV,
    TPU_RESOURCE,
    TPU_TOPOLOGY_ENV,
    TPU_WORKER_ID_ENV,
)
from tpuray.slices.distributed import RankInfo, torchrun_env
from tpuray.slices.worker import SliceWorker, WorkerPlacement
from tpuray.topology import SliceTopology, multislice_env
from tpuray.validation import ConfigError, check_choice, check_positive_int, is_number

logger = logging.getLogger(__name__)

MEGASCALE_PORT = 8081  # multi-slice coordinator port (Ray's default)
TEARDOWN_TIMEOUT_S = 10.0


class PlacementError(RuntimeError):
    """Ray placed a worker where the slice layout says it cannot run (the group was released)."""


@dataclass(frozen=True)
class WorkerGroupSpec:
    """What to start: `num_workers` actors, on `num_slices` TPU slices of `topology` when given."""

    num_workers: int
    topology: SliceTopology | None = None
    num_slices: int = 1
    chips_per_worker: int = 1
    num_cpus: float = 0.0  # per worker
    num_gpus: float = 0.0  # per worker (CPU/GPU groups only)
    resources: dict[str, float] = field(default_factory=dict)  # extra custom resources per worker
    placement_strategy: str = "PACK"  # CPU/GPU groups; a slice reservation is always one bundle per share
    reserve_timeout_s: float | None = 300.0  # also bounds the wait for the actors to start
    runtime_env: dict[str, Any] | None = None
    max_concurrency: int = 1
    name: str = ""
    """The reservation's name, its placement group's: who holds the slice (`tpuray status`), e.g.
    `holder_name("train", run)`."""

    def __post_init__(self) -> None:
        check_positive_int("num_workers", self.num_workers)
        check_positive_int("num_slices", self.num_slices)
        check_choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ConfigError(f"{name}={value!r} is invalid: use a number >= 0")
        if self.topology is None:
            return
        if self.num_gpus:
            raise ConfigError(f"num_gpus={self.num_gpus!r}: a TPU worker group takes no GPUs")
        self.topology.share_bounds(self.chips_per_worker)  # ConfigError lists the valid shares
        expected = self.num_slices * self.workers_per_slice
        if self.num_workers != expected:
            raise ConfigError(
                f"num_workers={self.num_workers} does not fill {self.num_slices} x {self.topology}: "
                f"{self.workers_per_slice} workers of {self.chips_per_worker} chip(s) per slice; valid: {expected}"
            )

    @property
    def workers_per_host(self) -> int:
        return self.topology.chips_per_host // self.chips_per_worker if self.topology else 1

    @property
    def workers_per_slice(self) -> int:
        return self.topology.num_chips // self.chips_per_worker if self.topology else self.num_workers


@dataclass
class Member:
    """One started worker: its actor, the bundle it holds, where it runs, its rank and process env."""

    actor: Any
    bundle: int
    placement: WorkerPlacement
    rank: RankInfo
    env: dict[str, str] = field(default_factory=dict)


def _tpu_rank(
    spec: WorkerGroupSpec, topo: SliceTopology, bundle: int, pl: WorkerPlacement, hostnames: list[str] | None
) -> tuple[RankInfo, dict[str, str]]:
    """(RankInfo, TPU process env) of the worker holding `bundle`; PlacementError if it cannot run there."""
    from tpuray.isolation import process_env

    slice_index, in_slice = divmod(bundle, spec.workers_per_slice)
    host = in_slice // spec.workers_per_host
    where = f"worker of bundle {bundle} (slice {slice_index}, host {host}) on node {pl.node_id}"
    stated = pl.host
    if TPU_TOPOLOGY_ENV in stated and TPU_ACCELERATOR_TYPE_ENV in stated:
        try:
            on_host = SliceTopology.parse(stated[TPU_ACCELERATOR_TYPE_ENV], stated[TPU_TOPOLOGY_ENV])
        except ValueError as e:
            raise PlacementError(f"{where}: the host env does not describe a TPU slice: {e}") from e
        if on_host != topo:
            raise PlacementError(f"{where}: the host belongs to a {on_host} slice, not {topo}")
    if pl.worker_id is not None and pl.worker_id != host:
        raise PlacementError(f"{where}: the host says {TPU_WORKER_ID_ENV}={pl.worker_id}, not {host}")
    environ = {
        **stated,
        TPU_ACCELERATOR_TYPE_ENV: topo.pod_type,
        TPU_TOPOLOGY_ENV: topo.topology,
        TPU_WORKER_ID_ENV: str(host),
    }
    try:
        env = process_env(environ, chips=list(pl.tpu_chips), hostnames=hostnames)
    except ValueError as e:
        raise PlacementError(
            f"{where}: Ray assigned chips {list(pl.tpu_chips)}, which this worker cannot drive: {e}. Another "
            "process probably holds chips of this host outside the reservation"
        ) from e
    slice_rank = int(env[CLOUD_TPU_TASK_ID_ENV])
    per_host = spec.workers_per_host
    rank = RankInfo(
        world_rank=slice_index * spec.workers_per_slice + slice_rank,
        world_size=spec.num_workers,
        local_rank=slice_rank % per_host,
        local_world_size=per_host,
        node_rank=slice_index * topo.num_hosts + host,
        slice_index=slice_index,
        slice_rank=slice_rank,
    )
    return rank, env


def assign_ranks(
    spec: WorkerGroupSpec, placed: Sequence[tuple[int, WorkerPlacement]]
) -> list[tuple[RankInfo, dict[str, str]]]:
    """Rank and TPU env of each (bundle, placement), in input order. Pure: no Ray calls."""
    if spec.topology is None:
        node_order: list[str] = []
        for _, pl in sorted(placed, key=lambda bp: bp[0]):
            if pl.node_id not in node_order:
                node_order.append(pl.node_id)
        ordered = sorted(
            range(len(placed)), key=lambda i: (node_order.index(placed[i][1].node_id), placed[i][0])
        )
        counts = {n: sum(pl.node_id == n for _, pl in placed) for n in node_order}
        seen: dict[str, int] = {}
        out: list[Any] = [None] * len(placed)
        for world_rank, i in enumerate(ordered):
            node = placed[i][1].node_id
            local = seen.get(node, 0)
            seen[node] = local + 1
            out[i] = (
                RankInfo(
                    world_rank=world_rank,
                    world_size=len(placed),
                    local_rank=local,
                    local_world_size=counts[node],
                    node_rank=node_order.index(node),
                ),
                {},
            )
        return out
    topo = spec.topology
    out = []
    ips: dict[tuple[int, int], str] = {}
    for bundle, pl in placed:
        slice_index, in_slice = divmod(bundle, spec.workers_per_slice)
        ips.setdefault((slice_index, in_slice // spec.workers_per_host), pl.node_ip)
    for bundle, pl in placed:
        from tpuray.isolation import slice_hostnames

        slice_index = bundle // spec.workers_per_slice
        node_ips = [ips.get((slice_index, h), "") for h in range(topo.num_hosts)]
        hostnames = slice_hostnames(pl.host, topo, node_ips if all(node_ips) else None)
        out.append(_tpu_rank(spec, topo, bundle, pl, hostnames))
    ranks = sorted(r.world_rank for r, _ in out)
    if ranks != list(range(spec.num_workers)):
        raise PlacementError(f"workers were placed on overlapping chip shares (ranks {ranks})")
    return out


class SliceWorkerGroup:
    """Reserve, start, rank and set up `spec.num_workers` actors of `worker_cls` (a SliceWorker).

    group = SliceWorkerGroup(spec, TrainWorker).start()
    ray.get(group.init_process_group("tpu_dist", timeout_s=1800))
    ray.get(group.call("run", fn))          # one ref per rank, in rank order
    group.shutdown()                        # idempotent; also a context manager
    """

    def __init__(self, spec: WorkerGroupSpec, worker_cls: type[SliceWorker]) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, SliceWorker)):
            raise TypeError(f"worker_cls={worker_cls!r} must be a SliceWorker subclass")
        self.spec = spec
        self.worker_cls = worker_cls
        self.members: list[Member] = []  # in rank order once started
        self._started: list[tuple[Any, int]] = []  # (actor, bundle) of every actor created, for shutdown
        self._strategies: list[Any] = []  # the scheduling strategy of each bundle
        self.master_addr = ""
        self.master_port = 0
        self._spg: Any = None
        self._pg: Any = None

    # ---- start -------------------------------------------------------------------------------
    def start(self) -> SliceWorkerGroup:
        import ray

        try:
            self._strategies = strategies = self._reserve()
            self._create(strategies)
            try:
                placements = ray.get(
                    [actor.placement.remote() for actor, _ in self._started],
                    timeout=self.spec.reserve_timeout_s,
                )
            except ray.exceptions.GetTimeoutError as e:
                raise TimeoutError(
                    f"the {len(self._started)} workers of {self!r} did not start within "
                    f"{self.spec.reserve_timeout_s}s"
                ) from e
            placed = [(bundle, pl) for (_, bundle), pl in zip(self._started, placements, strict=True)]
            ranked = assign_ranks(self.spec, placed)
            self.members = sorted(
                (
                    Member(actor, bundle, pl, rank, env)
                    for (actor, bundle), pl, (rank, env) in zip(
                        self._started, placements, ranked, strict=True
                    )
                ),
                key=lambda m: m.rank.world_rank,
            )
            head = self.members[0]
            self.master_addr = head.placement.node_ip
            self.master_port = ray.get(head.actor.free_port.remote(), timeout=self.spec.reserve_timeout_s)
            for m in self.members:
                m.env = {**torchrun_env(m.rank, self.master_addr, self.master_port), **m.env}
                if self.spec.topology is not None and self.spec.num_slices > 1:
                    coordinator = f"{self.master_addr}:{MEGASCALE_PORT}"
                    m.env.update(multislice_env(coordinator, self.spec.num_slices, m.rank.slice_index))
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %r", self)
        return self

    def _reserve(self) -> list[Any]:
        """Reserve the bundles; the scheduling strategy of each worker, in bundle order."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        if spec.topology is not None:
            from tpuray.slices.placement import SlicePlacementGroup

            topo = spec.topology
            self._spg = SlicePlacementGroup(
                topology=topo.topology,
                accelerator_version=topo.generation.name,
                num_slices=spec.num_slices,
                resources_per_bundle={
                    TPU_RESOURCE: spec.chips_per_worker,
                    "CPU": spec.num_cpus,
                    **spec.resources,
                },
                timeout_s=spec.reserve_timeout_s,
                name=spec.name,
            )
            return [self._spg.scheduling_strategy(b) for b in range(self._spg.num_bundles)]
        bundle = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
        bundle = {k: float(v) for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
        self._pg = placement_group(
            [dict(bundle) for _ in range(spec.num_workers)], strategy=spec.placement_strategy, name=spec.name
        )
        try:
            ray.get(self._pg.ready(), timeout=spec.reserve_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"could not reserve {spec.num_workers} workers x {bundle} ({spec.placement_strategy}) within "
                f"{spec.reserve_timeout_s}s; cluster resources: {ray.cluster_resources()}"
            ) from exc
        return [
            PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=b)
            for b in range(spec.num_workers)
        ]

    def _create(self, strategies: list[Any]) -> None:
        import ray

        spec = self.spec
        actor_cls = ray.remote(self.worker_cls)
        resources = dict(spec.resources)
        if spec.topology is not None:
            resources[TPU_RESOURCE] = spec.chips_per_worker
        for bundle, strategy in enumerate(strategies):
            actor = actor_cls.options(
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                resources=resources or None,
                scheduling_strategy=strategy,
                runtime_env=spec.runtime_env,
                max_concurrency=spec.max_concurrency,
            ).remote()
            self._started.append((actor, bundle))  # tracked for shutdown right away

    # ---- use ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def emulated(self) -> bool:
        return any(m.placement.emulated for m in self.members)

    @property
    def slice_names(self) -> list[str]:
        return self._spg.slice_names if self._spg is not None else []

    def node_ids(self) -> list[str]:
        """The Ray node ids the workers run on, sorted."""
        return sorted({m.placement.node_id for m in self.members})

    def host_strategies(self) -> list[Any]:
        """A scheduling strategy into one bundle of each host of the group (per-host work, e.g. a model
        downloaded once per host), in rank order of the hosts."""
        first: dict[str, int] = {}
        for m in self.members:
            first.setdefault(m.placement.node_id, m.bundle)
        return [self._strategies[b] for b in first.values()]

    @property
    def actors(self) -> list[Any]:
        return [m.actor for m in self.members]

    def init_process_group(self, backend: str | None, timeout_s: float) -> list[Any]:
        """Install every rank's env and (with a backend) create the process group; refs in rank order."""
        return [m.actor.setup_distributed.remote(m.env, backend, timeout_s) for m in self.members]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(*args, **kwargs)` on every worker; object refs in rank order."""
        return [getattr(m.actor, method).remote(*args, **kwargs) for m in self.members]

    def call_each(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        """`method(*args_per_rank[r])` on rank r; object refs in rank order."""
        if len(args_per_rank) != len(self.members):
            raise ValueError(
                f"args_per_rank has {len(args_per_rank)} entries for {len(self.members)} workers"
            )
        return [getattr(m.actor, method).remote(*a) for m, a in zip(self.members, args_per_rank, strict=True)]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "rank": m.rank.world_rank,
                "node_ip": m.placement.node_ip,
                "pid": m.placement.pid,
                "tpu_chips": list(m.placement.tpu_chips),
                "slice": m.placement.slice_name,
                "emulated": m.placement.emulated,
            }
            for m in self.members
        ]

    # ---- teardown ----------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        """Destroy the process group (`graceful`: wait up to TEARDOWN_TIMEOUT_S for every rank), kill every
        actor, release the reservation. Safe to call twice and on a partially started group; after a
        failure pass graceful=False (ranks may be stuck in a collective with a dead peer)."""
        import ray

        members, self.members = self.members, []
        started, self._started = self._started, []
        if started and ray.is_initialized():
            if graceful and members:
                refs = [m.actor.teardown_distributed.remote() for m in members]
                ray.wait(refs, num_returns=len(refs), timeout=TEARDOWN_TIMEOUT_S)
            for actor, _ in started:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
        spg, self._spg = self._spg, None
        if spg is not None:
            spg.shutdown()
        pg, self._pg = self._pg, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                logger.debug("placement group %s already removed", pg.id)

    def __enter__(self) -> SliceWorkerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        spec = self.spec
        if spec.topology is not None:
            where = f"{spec.num_slices} x {spec.topology.pod_type} ({spec.topology.topology})"
            where += f", {spec.chips_per_worker} chip(s) per worker"
        else:
            where = f"CPU{'/GPU' if spec.num_gpus else ''} ({spec.placement_strategy})"
        tag = " [EMULATED TPU]" if self.emulated else ""
        return f"SliceWorkerGroup({spec.num_workers} x {self.worker_cls.__name__} on {where}{tag})"
