"""What TPU slices a Ray cluster has, read from node labels and resources (real or emulated)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from tpuray.constants import (
    ACCELERATOR_LABEL,
    EMULATED_CORES_LABEL,
    EMULATED_LABEL,
    POD_TYPE_LABEL,
    SLICE_NAME_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    WORKER_ID_LABEL,
    head_resource,
)


@dataclass
class SliceInfo:
    """One TPU slice as Ray sees it right now."""

    name: str
    accelerator_type: str
    topology: str
    pod_type: str
    emulated: bool
    node_ids: list[str] = field(default_factory=list)  # ordered by worker id
    expected_hosts: int | None = None
    chips: int = 0
    free_chips: int = 0
    head_free: bool = False
    draining: bool = False  # a host has a preemption notice (Ray drain): nothing new is placed there
    cores: str = ""  # emulated with cores of its own (cores="per_slice"): which, e.g. "0,1"; else ""
    holders: list[str] = field(default_factory=list)  # names of the reservations on it (holder_name)

    @property
    def hosts(self) -> int:
        return len(self.node_ids)

    @property
    def intact(self) -> bool:
        return self.expected_hosts is None or self.hosts == self.expected_hosts

    @property
    def idle(self) -> bool:
        return self.head_free and self.free_chips == self.chips


def list_slices() -> list[SliceInfo]:
    """Every TPU slice of the connected Ray cluster, sorted by name (requires ray.init())."""
    import ray
    from ray._private.state import available_resources_per_node

    from tpuray.slices.drain import draining_nodes

    return slices_from_state(
        ray.nodes(), available_resources_per_node(), draining_nodes(), ray.util.placement_group_table()
    )


def slices_from_state(
    nodes: list[dict[str, Any]],
    available: dict[str, dict[str, float]],
    draining: Collection[str],
    pg_table: dict[str, dict[str, Any]],
) -> list[SliceInfo]:
    """The slices of a cluster state as Ray reports it (`ray.nodes()`, available resources per node, the
    draining nodes, `placement_group_table()`), sorted by name: one pass over the nodes and one over the
    placement groups (benchmarks/bench_bookkeeping.py times it on 4,096 hosts)."""
    slices: dict[str, SliceInfo] = {}
    workers: dict[str, list[tuple[int, str]]] = {}
    for node in nodes:
        labels, resources = node.get("Labels") or {}, node.get("Resources") or {}
        name = labels.get(SLICE_NAME_LABEL)
        if not node.get("Alive") or not name or not resources.get(TPU_RESOURCE):
            continue
        info = slices.get(name) or slices.setdefault(name, _new_slice(name, labels))
        node_id = node["NodeID"]
        info.draining = info.draining or node_id in draining
        node_avail = available.get(node_id, resources)
        info.chips += int(resources[TPU_RESOURCE])
        info.free_chips += int(node_avail.get(TPU_RESOURCE, 0))
        worker_id = int(labels.get(WORKER_ID_LABEL, "0") or 0)
        workers.setdefault(name, []).append((worker_id, node_id))
        head = head_resource(info.pod_type)
        if worker_id == 0 and resources.get(head):
            info.head_free = node_avail.get(head, 0) >= 1
    for name, info in slices.items():
        info.node_ids = [node_id for _, node_id in sorted(workers[name])]
    holders = slice_holders(pg_table, slices.values())
    for name, info in slices.items():
        info.holders = holders.get(name, [])
    return [slices[k] for k in sorted(slices)]


def _new_slice(name: str, labels: dict[str, str]) -> SliceInfo:
    from tpuray.topology import SliceTopology

    info = SliceInfo(
        name=name,
        accelerator_type=labels.get(ACCELERATOR_LABEL, ""),
        topology=labels.get(TOPOLOGY_LABEL, ""),
        pod_type=labels.get(POD_TYPE_LABEL, ""),
        emulated=labels.get(EMULATED_LABEL) == "true",
        cores=labels.get(EMULATED_CORES_LABEL, ""),
    )
    try:
        info.expected_hosts = SliceTopology.parse(info.pod_type, info.topology).num_hosts
    except ValueError:
        info.expected_hosts = None
    return info


def known_slices(nodes: list[dict[str, Any]]) -> dict[str, tuple[str, str, str]]:
    """Every slice the cluster has had a host of, alive or not (a lost host may be brought back):
    {slice name: (accelerator type, topology, pod type)}, from `ray.nodes()`."""
    known: dict[str, tuple[str, str, str]] = {}
    for node in nodes:
        labels = node.get("Labels") or {}
        name = labels.get(SLICE_NAME_LABEL)
        if name and name not in known and (node.get("Resources") or {}).get(TPU_RESOURCE, 1):
            pod_type = labels.get(POD_TYPE_LABEL, "")
            known[name] = (
                labels.get(ACCELERATOR_LABEL, "") or pod_type,
                labels.get(TOPOLOGY_LABEL, ""),
                pod_type,
            )
    return known


HolderKind = Literal["train", "serve", "rl"]
HEADS_SUFFIX = "-heads"  # SlicePlacementGroup's placement group of slice heads: "<name>-heads"


def holder_name(kind: HolderKind, what: str) -> str:
    """The name tpuray gives a reservation (its placement group's), which `tpuray status` shows as the
    slice's holder: "train:<run>#<id>", "serve:<model id>#<id>", "rl:<part>#<id>". Ray wants placement
    group names unique (two replicas of one model each hold a slice): <id> is 4 random hex digits."""
    import uuid

    return f"{kind}:{what}#{uuid.uuid4().hex[:4]}" if what else f"{kind}#{uuid.uuid4().hex[:4]}"


def slice_holders(pg_table: dict[str, dict[str, Any]], slices: Any) -> dict[str, list[str]]:
    """{slice name: the names of the live placement groups with a bundle on one of its hosts}, from
    `ray.util.placement_group_table()`; an unnamed group shows as "placement group <id>"."""
    slice_of = {node: s.name for s in slices for node in s.node_ids}
    holders: dict[str, list[str]] = {}
    for pg_id, pg in pg_table.items():
        if pg.get("state") not in ("CREATED", "RESCHEDULING"):
            continue
        name = pg.get("name") or f"placement group {pg_id[:8]}"
        name = name.removesuffix(HEADS_SUFFIX)  # a reservation's heads: the same holder
        for node in set((pg.get("bundles_to_node_id") or {}).values()):
            held = holders.setdefault(slice_of[node], []) if node in slice_of else None
            if held is not None and name not in held:
                held.append(name)
    return holders


def _kind(s: SliceInfo) -> str:
    if not s.emulated:
        return "real"
    return f"EMULATED (cores {s.cores})" if s.cores else "EMULATED"


def format_slices(slices: list[SliceInfo]) -> str:
    """A small text table (used by `tpuray status`)."""
    if not slices:
        return "no TPU slices in this Ray cluster"
    header = ("SLICE", "TYPE", "TOPOLOGY", "HOSTS", "CHIPS FREE", "STATE", "KIND", "HELD BY")
    rows = [header]
    for s in slices:
        hosts = f"{s.hosts}/{s.expected_hosts}" if s.expected_hosts else str(s.hosts)
        state = "free" if s.idle else ("busy" if s.free_chips < s.chips else "reserved")
        if not s.intact:
            state = "incomplete"
        if s.draining:
            state = "draining (preemption notice)"
        rows.append(
            (
                s.name,
                s.accelerator_type or s.pod_type,
                s.topology,
                hosts,
                f"{s.free_chips}/{s.chips}",
                state,
                _kind(s),
                ", ".join(s.holders) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def pending_slice_demand(pg_table: dict[str, dict[str, Any]] | None = None) -> dict[str, int]:
    """Slices asked for but not placed yet: pending (or rescheduling) placement groups that hold a slice
    head bundle ({"TPU-<pod type>-head": 1}, what Ray's and tpuray's SlicePlacementGroup reserve first),
    counted by pod type ({"v6e-16": 2}). This is the demand Ray's autoscaler turns into slices.
    `pg_table`: `ray.util.placement_group_table()` (read from the connected cluster when None)."""
    if pg_table is None:
        import ray

        pg_table = ray.util.placement_group_table()
    demand: dict[str, int] = {}
    for pg in pg_table.values():
        if pg.get("state") not in ("PENDING", "RESCHEDULING"):
            continue
        for bundle in pg.get("bundles", {}).values():
            for key in bundle:
                if key.startswith("TPU-") and key.endswith("-head"):
                    pod_type = key[len("TPU-") : -len("-head")]
                    demand[pod_type] = demand.get(pod_type, 0) + 1
    return demand
