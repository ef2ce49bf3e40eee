"""Whole slices under churn: the invariant of an autoscaling emulated cluster, and a seeded random schedule
of reservations, releases and preemptions that checks it after every event.

Used by tests/emulator/test_autoscale.py (a few cycles) and benchmarks/bench_autoscale.py (20 cycles).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpuray.constants import SLICE_NAME_LABEL

if TYPE_CHECKING:
    from tpuray.emulator.cluster import EmulatedCluster


@dataclass
class SliceAudit:
    """One look at the cluster: slices with all hosts alive, partial slices, and leaked TPU nodes."""

    whole: dict[str, list[str]] = field(default_factory=dict)  # slice name -> alive node ids
    partial: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    settling: list[str] = field(default_factory=list)  # slices the autoscaler is starting or stopping

    @property
    def ok(self) -> bool:
        return not self.partial and not self.leaked


def audit(cluster: EmulatedCluster) -> SliceAudit:
    """Every alive TPU host must belong to a slice started by hand or by the autoscaler (else: leaked).
    A slice is partial when some of its hosts are alive without the others, except while the autoscaler
    starts it (worker 0, the host every reservation takes first, comes last) or stops it."""
    import ray

    published = cluster.autoscaled_slices()
    known = {sl.name: list(sl.node_ids) for sl in cluster.slices}
    known.update({name: s["node_ids"] for name, s in published.items()})
    alive: dict[str, list[str]] = {}
    for n in ray.nodes():
        name = (n.get("Labels") or {}).get(SLICE_NAME_LABEL)
        if n["Alive"] and name:
            alive.setdefault(name, []).append(n["NodeID"])
    out = SliceAudit(settling=[n for n, s in published.items() if s["state"] != "up"])
    for name, ids in alive.items():
        want = known.get(name)
        if want is None or not set(ids) <= set(want):
            out.leaked += [i for i in ids if want is None or i not in want]
        elif sorted(ids) == sorted(want):
            out.whole[name] = ids
        elif name not in out.settling or want[0] in ids:
            out.partial.append(name)
    return out


def settle(cluster: EmulatedCluster, timeout_s: float = 180.0) -> SliceAudit:
    """Wait until the autoscaler starts or stops nothing and every slice it reports is whole or gone,
    then audit (the timeout only bounds a broken cluster: the audit then says what is wrong)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = audit(cluster)
        up = [n for n, s in cluster.autoscaled_slices().items() if s["state"] == "up"]
        if (not seen.settling and set(up) <= set(seen.whole) and seen.ok) or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


@dataclass
class ChurnReport:
    cycles: int
    events: list[str] = field(default_factory=list)
    audits: int = 0
    partial: int = 0  # partial slices seen, summed over every audit
    leaked: int = 0  # leaked TPU nodes seen, summed over every audit (and processes left at the end)
    slices_started: set[str] = field(default_factory=set)
    seconds: float = 0.0


def _canon(shape: tuple[str, str]) -> tuple[str, str]:
    from tpuray.topology import SliceTopology

    topo = SliceTopology.parse(*shape)
    return topo.generation.accelerator_type, topo.topology


class _Churn:
    """One seeded schedule on `cluster`: what is held, what was seen (run_churn)."""

    def __init__(
        self, cluster: EmulatedCluster, seed: int, preempt_probability: float, on_event: Any
    ) -> None:
        from tpuray.slices.autoscaler import published_node_types

        self.cluster = cluster
        self.rng = random.Random(seed)
        self.preempt_probability = preempt_probability
        self.on_event = on_event
        self.held: list[tuple[str, tuple[str, str], Any]] = []  # (slice name, shape, reservation)
        self.pids: set[int] = set()
        self.limit = {(t.accelerator_type, t.topology): t.max_slices for t in published_node_types() or []}

    def event(self, report: ChurnReport, what: str) -> None:
        seen = settle(self.cluster)
        self.pids.update(p for s in self.cluster.autoscaled_slices().values() for p in s["pids"])
        report.events.append(what)
        report.audits += 1
        report.partial += len(seen.partial)
        report.leaked += len(seen.leaked)
        report.slices_started.update(seen.whole)
        if self.on_event is not None:
            self.on_event(what, seen)

    def reserve(self, report: ChurnReport, shapes: list[tuple[str, str]]) -> int:
        """Reserve a slice of a random shape the autoscaler can still bring; how many shapes could."""
        from tpuray.slices.placement import SlicePlacementGroup

        free = [s for s in shapes if sum(1 for h in self.held if h[1] == s) < self.limit.get(_canon(s), 0)]
        if free:
            shape = self.rng.choice(free)
            spg = SlicePlacementGroup(shape[1], shape[0], timeout_s=300)
            self.held.append((spg._slice_names[0], shape, spg))
            self.event(report, f"reserve {shape[0]} {shape[1]} -> {spg._slice_names[0]}")
        return len(free)

    def release(self, report: ChurnReport, i: int) -> None:
        """Release held reservation `i`, or first preempt one host of its slice."""
        name, _, spg = self.held.pop(i)
        if self.rng.random() < self.preempt_probability:
            published = self.cluster.autoscaled_slices().get(name)
            if published is not None:
                host = published["node_ids"][-1]
                self.cluster.preempt_host(host, notice_s=0).wait_killed(timeout_s=120)
                self.event(report, f"preempt {name} host {host[:8]}")
        spg.shutdown()
        self.event(report, f"release {name}")

    def wind_down(self, report: ChurnReport) -> None:
        """Release everything held; every slice must then idle out, whole, and no process be left."""
        from tpuray.emulator.detached import _alive

        while self.held:
            self.release(report, 0)
        deadline = time.monotonic() + 300
        while self.cluster.autoscaled_slices() and time.monotonic() < deadline:
            time.sleep(0.5)
        self.event(report, "all idle slices gone")
        report.leaked += len(self.cluster.autoscaled_slices()) + sum(1 for p in self.pids if _alive(p))


def run_churn(
    cluster: EmulatedCluster,
    shapes: list[tuple[str, str]],
    cycles: int,
    seed: int,
    preempt_probability: float = 0.25,
    on_event: Callable[[str, SliceAudit], None] | None = None,
) -> ChurnReport:
    """`cycles` times: reserve a slice of a random shape (tpuray SlicePlacementGroup), then release a random
    held reservation, or first preempt one host of its slice (the slice must go whole and a replacement
    come). The cluster is audited after every event once it has settled."""
    churn = _Churn(cluster, seed, preempt_probability, on_event)
    report = ChurnReport(cycles)
    start = time.monotonic()
    for _ in range(cycles):
        free = churn.reserve(report, shapes)
        if churn.held and (churn.rng.random() < 0.5 or free <= 1):
            churn.release(report, churn.rng.randrange(len(churn.held)))
    churn.wind_down(report)
    report.seconds = time.monotonic() - start
    return report
