"""Starting a worker group without waiting on a slice that is going away (training's attempts, and
any other owner of a `SliceWorkerGroup`).

Ray schedules nothing new on a draining host, and a placement group whose host died waits for a
replacement: workers asked for on a slice that is preempted while they start would wait for the whole
reservation timeout. `start_group` runs `SliceWorkerGroup.start()` (itself bounded by the spec's
`reserve_timeout_s`) on a helper thread while the calling thread watches the hosts of the reserved
slices; when one drains or dies, it aborts the start (`group.shutdown()`) and says what happened.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tpuray.slices.drain import DrainWatch, PreemptionInfo, dead_nodes, slice_node_ids
from tpuray.slices.worker_group import SliceWorkerGroup


@dataclass
class LostWhileStarting:
    """A reserved slice went while the workers started: its drain notice, and/or the hosts Ray reports
    dead (node id -> died after a drain for preemption)."""

    info: PreemptionInfo | None = None
    dead: dict[str, bool] = field(default_factory=dict)

    @property
    def preempted(self) -> bool:
        return self.info is not None or any(self.dead.values())

    def __str__(self) -> str:
        if self.info is not None:
            return "a reserved slice got a preemption notice while the workers started"
        if not self.dead:
            return "the reserved slice(s) had no live host left while the workers started"
        hosts = [n[:12] for n in sorted(self.dead)]
        return f"host(s) {hosts} of the reserved slice(s) died while the workers started"


def start_group(group: SliceWorkerGroup, poll_s: float) -> LostWhileStarting | None:
    """`group.start()`, aborted when a host of its slices drains or dies meanwhile (returns what happened;
    the group is shut down). None once the group started; start()'s own errors are raised."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            group.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="tpuray-group-start", daemon=True)
    thread.start()
    nodes: list[str] = []
    watch: DrainWatch | None = None
    lost: LostWhileStarting | None = None
    while thread.is_alive():
        thread.join(poll_s)
        if lost is not None or not thread.is_alive():
            continue
        if watch is None:
            names = group.slice_names  # known once the slices are reserved
            if not names:
                continue
            nodes = slice_node_ids(names)
            watch = DrainWatch({node: [] for node in nodes}, min_interval_s=0)
        info = watch.poll()
        dead = dead_nodes(nodes)
        if info is not None or dead or not nodes:
            lost = LostWhileStarting(info, dead)
            group.shutdown(graceful=False)  # the start fails at once (its actors are gone)
    thread.join()
    if lost is not None:
        group.shutdown(graceful=False)  # also what start() created after the first shutdown
        return lost
    if "error" in outcome:
        raise outcome["error"]
    return None
