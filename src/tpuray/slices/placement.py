"""SlicePlacementGroup: reserve whole TPU slices atomically with Ray placement groups.

Same two steps as Ray's `ray.util.tpu.SlicePlacementGroup`, with the same constructor names:
1. a head placement group `[{"TPU-<pod>-head": 1}] * num_slices` (label selector: pod type, and worker
   id 0 where the demand is `head`;
   one group for every slice, where Ray's makes one per slice, so several slices are had at once or not
   at all; on Ray's v2 autoscaler also one companion bundle per other host, so that the pending group
   reads as whole slices: tpuray.slices.demand) picks free slices; the slice name is read from the node
   the head bundle landed on (node labels, no extra task); while a `SliceClaim` of the shape is open in
   this process, its claimed heads are borrowed instead (tpuray.slices.claim: several parts' slices
   chosen in one request);
2. one placement group with one bundle per host (or per chip share), each bound by label selector to
   `{ray.io/tpu-slice-name: <slice>, ray.io/tpu-worker-id: <worker>}`, ordered slice-major by worker id,
   each also asking for a sliver of the slice's own resource (`<slice>`, which Ray gives its hosts), so
   that Ray's autoscaler, which reads resources and not labels, sees the bundles as that slice's.
The constructor returns once every bundle is placed; if that does not happen within `timeout_s`, every
placement group it created is removed and SliceReservationTimeout says what was asked and what exists.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Literal

from tpuray.constants import (
    PLACEMENT_STRATEGIES,
    SLICE_NAME_LABEL,
    TPU_RESOURCE,
    WORKER_ID_LABEL,
)
from tpuray.slices.demand import free_slices, head_request, slice_demand
from tpuray.slices.inventory import HEADS_SUFFIX, format_slices, list_slices
from tpuray.topology import SliceTopology, get_generation
from tpuray.validation import ConfigError, check_choice, check_positive_int, is_number

if TYPE_CHECKING:
    from tpuray.slices.lending import Loan

logger = logging.getLogger(__name__)

# Of the slice-name resource (1 per host), what one bundle takes: room for 1000 bundles per host.
SLICE_RESOURCE_SHARE = 0.001


SETTLE_S = (
    2.0  # how long bundles may wait on a slice whose chips others hold before the reservation looks again
)
RETRY_PAUSE_S = 0.2
PROGRESS_S = 15.0  # while it waits for slice heads, a reservation says so this often


class SliceReservationTimeout(TimeoutError):
    """No free slice(s) within the timeout. Nothing stays reserved."""


def _validate_bundle(resources_per_bundle: dict[str, float] | None, topo: SliceTopology) -> dict[str, float]:
    """The bundle of one host (or chip share): CPU 1 and the host's chips unless given."""
    chips_per_host = topo.chips_per_host
    if resources_per_bundle is None:
        return {"CPU": 1.0, TPU_RESOURCE: float(chips_per_host)}
    if not isinstance(resources_per_bundle, dict) or not resources_per_bundle:
        raise ConfigError(f"resources_per_bundle must be a non-empty dict, got {resources_per_bundle!r}")
    for key, value in resources_per_bundle.items():
        if not is_number(value) or value < 0:
            raise ConfigError(f"resources_per_bundle[{key!r}]={value!r} must be a number >= 0")
    bundle = {k: float(v) for k, v in resources_per_bundle.items()}
    bundle.setdefault("CPU", 1.0)
    bundle.setdefault(TPU_RESOURCE, float(chips_per_host))
    tpu = bundle[TPU_RESOURCE]
    if tpu != int(tpu) or int(tpu) not in topo.process_shares():
        valid = list(topo.process_shares())
        raise ConfigError(
            f"resources_per_bundle TPU={tpu:g} must be a chip share of the {chips_per_host}-chip hosts of "
            f"{topo.pod_type}; valid: {valid}"
        )
    return bundle


def _check_options(
    topo: SliceTopology,
    chips_per_vm: int | None,
    strategy: str,
    lifetime: str | None,
    timeout_s: float | None,
    head_timeout_s: float | None,
) -> None:
    """SlicePlacementGroup's options other than the shape and the bundle, before anything is reserved."""
    if chips_per_vm is not None and chips_per_vm != topo.chips_per_host:
        raise ConfigError(
            f"chips_per_vm={chips_per_vm!r} does not match {topo.pod_type} ({topo.topology}), which has "
            f"{topo.chips_per_host} chips per host"
        )
    check_choice("strategy", strategy, PLACEMENT_STRATEGIES)
    if lifetime not in (None, "detached"):
        raise ConfigError(f"lifetime={lifetime!r} is not valid; valid: None, 'detached'")
    for what, value in (("timeout_s", timeout_s), ("head_reservation_timeout_s", head_timeout_s)):
        if value is not None and (not is_number(value) or value <= 0):
            raise ConfigError(f"{what} must be a number > 0 or None (wait forever), got {value!r}")


class SlicePlacementGroup:
    """A reservation of `num_slices` whole TPU slices: one placement group, bundles slice-major by worker id."""

    def __init__(
        self,
        topology: str,
        accelerator_version: str,
        resources_per_bundle: dict[str, float] | None = None,
        strategy: str = "SPREAD",
        name: str = "",
        lifetime: str | None = None,
        num_slices: int = 1,
        chips_per_vm: int | None = None,
        head_reservation_timeout_s: float | None = None,
        bundle_label_selector: list[dict[str, str]] | None = None,
        timeout_s: float | None = 60.0,
    ) -> None:
        self._head_pgs: list[Any] = []
        self._loan: Loan | None = None  # heads lent by an open SliceClaim, in place of _head_pgs
        self._pg: Any = None
        # -- validate everything before touching the cluster --
        self._generation = get_generation(accelerator_version)
        self._topology = SliceTopology.parse(self._generation.accelerator_type, topology)
        topo = self._topology
        check_positive_int("num_slices", num_slices)
        _check_options(topo, chips_per_vm, strategy, lifetime, timeout_s, head_reservation_timeout_s)
        self._bundle = _validate_bundle(resources_per_bundle, topo)
        self._bundles_per_host = topo.chips_per_host // int(self._bundle[TPU_RESOURCE])
        self._num_slices = num_slices
        self._bundles_per_slice = topo.num_hosts * self._bundles_per_host
        if bundle_label_selector is not None and len(bundle_label_selector) != self.num_bundles:
            raise ConfigError(
                f"bundle_label_selector has {len(bundle_label_selector)} entries; it must have one per "
                f"bundle ({self.num_bundles})"
            )
        self._user_selector = bundle_label_selector or [{} for _ in range(self.num_bundles)]
        self._strategy, self._name, self._lifetime = strategy, name, lifetime
        self._timeout_s = timeout_s
        self._head_timeout_s = head_reservation_timeout_s  # Ray's meaning: the wait for the head(s)
        self._slice_names: list[str] = []
        self._selector: list[dict[str, str]] = []

        import ray

        if not ray.is_initialized():
            raise RuntimeError("SlicePlacementGroup needs a Ray connection: call ray.init() first")
        try:
            self._reserve()
        except BaseException:
            self.shutdown()
            raise

    # -- reservation ----------------------------------------------------------------------------

    def _remaining(self, start: float) -> float | None:
        if self._timeout_s is None:
            return None
        return max(0.0, self._timeout_s - (time.monotonic() - start))

    def _reserve(self) -> None:
        """Reserve, and look again while the chosen slice's chips are held by others (below)."""
        start = time.monotonic()
        while not self._try_reserve(start):
            self.shutdown()  # this try's head(s) and bundles: free for the next look
            time.sleep(RETRY_PAUSE_S)

    def _try_reserve(self, start: float) -> bool:
        """Heads, then the hosts' bundles. False when the bundles wait on a slice whose chips another
        placement group or actor holds without its head (a head alone does not prove its hosts idle)
        while another slice of the shape has become idle: the caller releases and looks again, so that
        the freed slice is taken instead of waiting out the timeout on the busy one."""
        from ray.util.placement_group import placement_group

        idle, head_resources = self._reserve_heads(start)
        bundles, self._selector = self._host_bundles(head_resources)
        self._pg = placement_group(
            bundles,
            strategy=self._strategy,
            name=self._name,
            lifetime=self._lifetime,
            bundle_label_selector=self._selector,
        )
        busy = [n for n in self._slice_names if n not in idle]
        outcome = self._wait_bundles(start, bool(busy))
        if outcome == "placed":
            logger.info("reserved %s", self)
            if self._loan is not None:
                self._loan.placed()
            return True
        if outcome == "timeout":
            self._fail(
                f"slice head(s) {self._slice_names} reserved, but their hosts' bundles could not be placed"
            )
        logger.info("slice(s) %s have chips held by others and another slice is idle: looking again", busy)
        return False

    def _wait_bundles(self, start: float, busy: bool) -> Literal["placed", "look_again", "timeout"]:
        """Wait for the hosts' bundles. On a busy slice, every SETTLE_S while there is time for another
        try, check whether a slice of this shape has become idle: then "look_again"; otherwise keep
        waiting here, holding what is reserved (a new look would only release and re-create the same
        placement groups). "timeout" once the time is out."""
        import ray

        while True:
            remaining = self._remaining(start)
            again = busy and (remaining is None or remaining > 2 * SETTLE_S)
            waits = [w for w in (SETTLE_S if again else None, remaining) if w is not None]
            ready, _ = ray.wait([self._pg.ready()], timeout=min(waits) if waits else None)
            if ready:
                return "placed"
            if not again:
                return "timeout"
            if self._idle_slice_elsewhere():
                return "look_again"

    def _idle_slice_elsewhere(self) -> bool:
        """A slice of this shape, not one of this try's, whose chips are all free now."""
        same = [s for s in list_slices() if s.pod_type == self._topology.pod_type]
        return any(name not in self._slice_names for name in free_slices(same))

    def _reserve_heads(self, start: float) -> tuple[list[str], list[dict[str, float]]]:
        """One head placement group with a bundle per slice (the slice's worker-0 head resource), preferring
        slices whose chips are all free; sets `_slice_names`. Returns the names of the slices that were idle and the
        resources of each reserved slice's head node. Heads an open SliceClaim lends are taken instead
        (tpuray.slices.claim)."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        from tpuray.slices import lending

        topo = self._topology
        self._loan = lending.lend(topo.pod_type, self._num_slices)
        if self._loan is not None:  # an open SliceClaim holds heads of this shape: no head of our own
            self._slice_names = list(self._loan.names)
            logger.info("slice(s) %s: heads lent by %r", self._slice_names, self._loan.lender)
            return list(self._slice_names), list(self._loan.resources)
        request = head_request([(topo, self._num_slices)], slice_demand())
        # every slice's head in ONE placement group, which Ray places whole or not at all: two requests
        # for several slices never each hold some of the free ones (Ray's: one placement group per head)
        heads = placement_group(
            request.bundles,
            strategy=request.strategy,
            bundle_label_selector=request.selectors,
            name=f"{self._name}{HEADS_SUFFIX}" if self._name else "",
            lifetime=self._lifetime,
        )
        self._head_pgs.append(heads)
        head_wait = self._remaining(start)
        if self._head_timeout_s is not None:
            head_wait = min(self._head_timeout_s, head_wait if head_wait is not None else math.inf)
        ready = self._wait_heads(heads, head_wait)
        if not ready:
            bound = ""
            if self._head_timeout_s is not None and head_wait == self._head_timeout_s:
                bound = f" within head_reservation_timeout_s={self._head_timeout_s}s"
            self._fail(f"the {self._num_slices} slice head(s) could not be reserved at once{bound}")
        placed = placement_group_table(heads)["bundles_to_node_id"]
        head_nodes = [placed[i] for i in range(self._num_slices)]
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        self._slice_names = [(nodes[n].get("Labels") or {})[SLICE_NAME_LABEL] for n in head_nodes]
        return request.idle, [nodes[n].get("Resources") or {} for n in head_nodes]

    def _wait_heads(self, heads: Any, timeout_s: float | None) -> bool:
        """Wait for the heads, saying every PROGRESS_S what the reservation waits for (the slices of its
        shape and who holds them); False when `timeout_s` passes first."""
        import ray

        start = time.monotonic()
        while True:
            left = None if timeout_s is None else timeout_s - (time.monotonic() - start)
            wait = PROGRESS_S if left is None else max(0.0, min(PROGRESS_S, left))
            ready, _ = ray.wait([heads.ready()], timeout=wait)
            if ready or (left is not None and left <= wait):
                return bool(ready)
            logger.warning("%s (%.0f s so far)", self._waiting_for(), time.monotonic() - start)

    def _waiting_for(self) -> str:
        topo = self._topology
        same = [s for s in list_slices() if s.pod_type == topo.pod_type]
        held = "; ".join(f"{s.name} held by {', '.join(s.holders) or 'others'}" for s in same) or "none up"
        return (
            f"waiting for {self._num_slices} free {topo.generation.accelerator_type} {topo.topology} slice(s) "
            f"(pod type {topo.pod_type}; the cluster's: {held})"
        )

    def _host_bundles(
        self, head_resources: list[dict[str, float]]
    ) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
        """Bundles and label selectors of every host of the reserved slices, slice-major by worker id."""
        bundles: list[dict[str, float]] = []
        selector: list[dict[str, str]] = []
        for slice_name, resources in zip(self._slice_names, head_resources, strict=True):
            bundle = dict(self._bundle)
            # Ray gives every host of a slice a resource named after it (TPU_NAME): asking for a sliver of it
            # says "this slice" in resources too, which Ray's autoscaler reads (it drops label selectors).
            # A bundle pinned to a lost slice is then demand no node type offers: it starts no new slice.
            if resources.get(slice_name):
                bundle[slice_name] = SLICE_RESOURCE_SHARE
            for worker in range(self._topology.num_hosts):
                for _ in range(self._bundles_per_host):
                    user = self._user_selector[len(selector)]
                    selector.append({**user, SLICE_NAME_LABEL: slice_name, WORKER_ID_LABEL: str(worker)})
                    bundles.append(dict(bundle))
        return bundles, selector

    def _fail(self, what: str) -> None:
        topo = self._topology
        self.shutdown()
        try:
            existing = format_slices(list_slices())
        except Exception as e:  # the error itself must not fail
            existing = f"(could not list slices: {e})"
        raise SliceReservationTimeout(
            f"could not reserve {self._num_slices} x {topo.generation.accelerator_type} {topo.topology} slice(s) "
            f"(pod type {topo.pod_type}, {topo.num_hosts} host(s) x {topo.chips_per_host} chips, head resource "
            f"{topo.head_resource}, bundle {self._bundle}) within {self._timeout_s}s: {what}. All partial "
            f"reservations were released. TPU slices in this cluster:\n{existing}"
        )

    # -- handle ---------------------------------------------------------------------------------

    @property
    def placement_group(self) -> Any:
        return self._pg

    @property
    def slice_placement_group(self) -> Any:  # Ray's name
        return self._pg

    @property
    def head_placement_groups(self) -> list[Any]:
        return list(self._head_pgs)

    @property
    def bundle_label_selector(self) -> list[dict[str, str]]:
        return [dict(s) for s in self._selector]

    @property
    def bundle_resources(self) -> dict[str, float]:
        return dict(self._bundle)

    @property
    def topology(self) -> SliceTopology:
        return self._topology

    @property
    def accelerator_version(self) -> str:
        return self._generation.name

    @property
    def num_slices(self) -> int:
        return self._num_slices

    @property
    def slice_names(self) -> list[str]:
        return list(self._slice_names)

    @property
    def num_hosts(self) -> int:
        """Hosts over all slices (Ray's meaning)."""
        return self._topology.num_hosts * self._num_slices

    @property
    def chips_per_host(self) -> int:
        return self._topology.chips_per_host

    @property
    def num_bundles(self) -> int:
        return self._bundles_per_slice * self._num_slices

    def node_ids(self) -> list[str]:
        """The Ray node ids of the reserved hosts (every host of every slice), sorted."""
        from ray.util.placement_group import placement_group_table

        if self._pg is None:
            return []
        return sorted(set(placement_group_table(self._pg)["bundles_to_node_id"].values()))

    def bundle_index(self, slice_index: int = 0, worker_id: int = 0, share: int = 0) -> int:
        """Bundle of chip share `share` on host `worker_id` of slice `slice_index`."""
        if not 0 <= slice_index < self._num_slices:
            raise ConfigError(f"slice_index {slice_index} out of range 0..{self._num_slices - 1}")
        if not 0 <= worker_id < self._topology.num_hosts:
            raise ConfigError(f"worker_id {worker_id} out of range 0..{self._topology.num_hosts - 1}")
        if not 0 <= share < self._bundles_per_host:
            raise ConfigError(f"share {share} out of range 0..{self._bundles_per_host - 1}")
        return slice_index * self._bundles_per_slice + worker_id * self._bundles_per_host + share

    def scheduling_strategy(self, bundle_index: int = -1) -> Any:
        """PlacementGroupSchedulingStrategy for one bundle (-1: any bundle)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._pg is None:
            raise RuntimeError("this SlicePlacementGroup was shut down")
        return PlacementGroupSchedulingStrategy(
            placement_group=self._pg,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )

    def release_head_pgs(self) -> None:
        """Drop the head reservations (the worker placement group keeps holding every chip). Idempotent.
        Heads lent by a SliceClaim stay with this reservation until shutdown()."""
        from ray.util.placement_group import remove_placement_group

        heads, self._head_pgs = self._head_pgs, []
        for pg in heads:
            try:
                remove_placement_group(pg)
            except Exception:
                logger.exception("failed to remove TPU head placement group %s", pg.id)

    def shutdown(self) -> None:
        """Release every placement group of this reservation. Idempotent; safe after a failed reserve."""
        from ray.util.placement_group import remove_placement_group

        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:
                logger.exception("failed to remove TPU slice placement group %s", pg.id)
        self.release_head_pgs()
        loan, self._loan = self._loan, None
        if loan is not None:  # back to the claim once the chips are free, not before
            loan.give_back()

    def __enter__(self) -> SlicePlacementGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        topo = self._topology
        state = "released" if self._pg is None else f"slices={self._slice_names}"
        return (
            f"SlicePlacementGroup({self._num_slices} x {topo.pod_type} {topo.topology}, "
            f"{self.num_bundles} bundle(s) of {self._bundle}, {state})"
        )


def slice_placement_group(
    topology: str,
    accelerator_version: str,
    resources_per_bundle: dict[str, float] | None = None,
    num_slices: int = 1,
    chips_per_vm: int | None = None,
    **kwargs: Any,
) -> SlicePlacementGroup:
    """Function form, as `ray.util.tpu.slice_placement_group` (kwargs: strategy, name, lifetime, timeout_s...)."""
    return SlicePlacementGroup(
        topology=topology,
        accelerator_version=accelerator_version,
        resources_per_bundle=resources_per_bundle,
        num_slices=num_slices,
        chips_per_vm=chips_per_vm,
        **kwargs,
    )
