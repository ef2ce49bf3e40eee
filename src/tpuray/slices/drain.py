"""Preemption notices: Ray Core's node drains, seen from a worker group or a serving replica.

A spot/preemptible TPU VM is reclaimed after a short notice. Ray learns of it as a *drain* of the node
(reason PREEMPTION, with a deadline: the call `ray drain-node` and KubeRay's autoscaler make) and stops
scheduling new work there; the node keeps running until the deadline, when the cloud takes it. A TPU
slice is lost as a whole, so a drain of any host of a slice takes every rank on that slice.

- `request_drain()`: issue a drain (the emulator's `preempt_*` uses it, as GKE's node pool would).
- `draining_nodes()`: Ray's draining nodes and their deadlines.
- `slice_node_ids()`, `dead_nodes()`: the live hosts of some slices; which of some nodes are gone, and
  whether each went after a drain for preemption (Ray's node death reason).
- `PreemptionInfo`: Ray Train V2's shape (deadline, preempted node -> affected ranks).
- `DrainWatch`: polls the drains that touch a given set of nodes and their failure domains.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tpuray.constants import DRAIN_REQUEST_TIMEOUT_S, SLICE_NAME_LABEL

PREEMPTION_REASON = "DRAIN_NODE_REASON_PREEMPTION"  # Ray's autoscaler_pb2.DrainNodeReason
PREEMPTED_DEATH = "AUTOSCALER_DRAIN_PREEMPTED"  # Ray's NodeDeathInfo.Reason of a node gone after that drain


@dataclass(frozen=True)
class PreemptionInfo:
    """An imminent preemption (the shape of Ray's `ray.train.PreemptionInfo`).

    deadline_ms: the earliest deadline of the preempted nodes (UNIX ms), None when none was given.
    preempted_node_to_ranks: each preempted node id -> the world ranks lost with it (a TPU slice is lost
    as a whole, so every rank of the node's slice).
    """

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def preempted_node_ids(self) -> list[str]:
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        return sorted({r for ranks in self.preempted_node_to_ranks.values() for r in ranks})

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (negative once it passed); None without a deadline."""
        if self.deadline_ms is None:
            return None
        return self.deadline_ms / 1000.0 - (time.time() if now is None else now)


def draining_nodes() -> dict[str, int]:
    """Ray Core's draining nodes: {node_id_hex: deadline_ms} (0 = no deadline). Needs ray.init()."""
    import ray._private.state

    return dict(ray._private.state.state.get_draining_nodes())


def request_drain(
    address: str, node_id: str, deadline_ms: int, message: str, reason: str = PREEMPTION_REASON
) -> None:
    """Ask the GCS at `address` to drain `node_id` by `deadline_ms` (UNIX ms; 0 = no deadline).

    The same call `ray drain-node` makes. Ray only marks the node: it stops scheduling there and tells
    whoever watches; it does not stop the node at the deadline (the caller does). An unreachable GCS
    fails it after DRAIN_REQUEST_TIMEOUT_S (Ray's own default waits forever).
    """
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address)
    accepted, why = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value(reason),
        message,
        deadline_ms,
        timeout=DRAIN_REQUEST_TIMEOUT_S,
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")


def slice_node_ids(slice_names: Iterable[str]) -> list[str]:
    """The live Ray nodes of the named slices (by the slice-name node label), sorted. Needs ray.init()."""
    import ray

    names = set(slice_names)
    if not names:
        return []
    return sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and (n.get("Labels") or {}).get(SLICE_NAME_LABEL) in names
    )


def dead_nodes(node_ids: Iterable[str]) -> dict[str, bool]:
    """Of `node_ids`, those Ray reports dead: {node_id: preempted}, preempted when the node went after a drain
    for preemption (Ray's death reason AUTOSCALER_DRAIN_PREEMPTED, as `ray.nodes()` shows it)."""
    import ray
    from ray.core.generated.common_pb2 import NodeDeathInfo

    preempted = NodeDeathInfo.Reason.Value(PREEMPTED_DEATH)
    wanted = set(node_ids)
    return {
        n["NodeID"]: n.get("DeathReason") == preempted
        for n in ray.nodes()
        if n["NodeID"] in wanted and not n["Alive"]
    }


def failure_domains(members: Iterable[tuple[str, str | None, int]]) -> dict[str, list[int]]:
    """{node_id: ranks lost when that node goes} from (node_id, slice name or None, rank) per worker:
    on a TPU slice every rank of the slice, elsewhere the ranks on the node."""
    on_node: dict[str, set[int]] = {}
    on_slice: dict[str, set[int]] = {}
    slice_of: dict[str, str | None] = {}
    for node_id, slice_name, rank in members:
        on_node.setdefault(node_id, set()).add(rank)
        slice_of[node_id] = slice_name
        if slice_name:
            on_slice.setdefault(slice_name, set()).add(rank)
    return {node: sorted(on_slice[s] if (s := slice_of[node]) else ranks) for node, ranks in on_node.items()}


class DrainWatch:
    """Watches the nodes of one worker group (or replica) for drains.

    watch = DrainWatch(failure_domains(...))
    info = watch.poll()   # None while none of the nodes drains, else the PreemptionInfo so far
    """

    def __init__(self, domains: Mapping[str, list[int]], min_interval_s: float = 0.2) -> None:
        self.domains = {node: list(ranks) for node, ranks in domains.items()}
        self.min_interval_s = min_interval_s
        self._last_poll = 0.0
        self.info: PreemptionInfo | None = None

    def poll(self, draining: Mapping[str, int] | None = None) -> PreemptionInfo | None:
        """The drains of our nodes (read from Ray at most every `min_interval_s`, unless given)."""
        if draining is None:
            now = time.monotonic()
            if now - self._last_poll < self.min_interval_s:
                return self.info
            self._last_poll = now
            draining = draining_nodes()
        ours = {node: deadline for node, deadline in draining.items() if node in self.domains}
        if not ours:
            return self.info  # a drain, once seen, stands until the node is gone
        deadlines = [d for d in ours.values() if d]
        if self.info is not None and self.info.deadline_ms is not None:
            deadlines.append(self.info.deadline_ms)
        seen = self.info.preempted_node_to_ranks if self.info else {}
        nodes = {**seen, **{node: self.domains[node] for node in ours}}
        self.info = PreemptionInfo(min(deadlines, default=None), dict(sorted(nodes.items())))
        return self.info


def describe(info: PreemptionInfo) -> str:
    """One line for logs: which nodes and ranks, and how long until the deadline."""
    left = info.seconds_left()
    when = "no deadline" if left is None else f"deadline in {max(left, 0.0):.1f}s"
    ranks = f" (ranks {info.preempted_ranks})" if info.preempted_ranks else ""
    return f"nodes {[n[:12] for n in info.preempted_node_ids]}{ranks}, {when}"
