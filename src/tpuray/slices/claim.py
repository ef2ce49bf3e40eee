"""SliceClaim: whole slices of several shapes chosen in ONE Ray placement group, all or none.

A SlicePlacementGroup chooses its slices by their heads (the `TPU-<pod>-head` resource of worker 0):
one placement group per reservation (all its heads, one shape). A job that needs slices for two parts
(an RL run: a trainer slice and a rollout slice) that reserved them one after the other could hold one
and wait for the other while
another job does the same. A claim asks for every head the job needs as the bundles of one placement
group, which Ray places whole or not at all, so two claims never split the free slices between them.

While a claim is open (`with claim:` or `open()` .. `close()`), a SlicePlacementGroup made in this
process for a claimed shape takes claimed heads instead of reserving its own (`lend`), and gives them
back if it is shut down before the claim ends (`tpuray.slices.lending`): the parts' reservations sit on the
claimed slices. A claimed head whose slice is draining or no longer whole is not lent (the part
reserves a head of its own, as without a claim). Once every claimed slice's chips are reserved by a
borrower, the claim lets go of the heads (close(): its placement group is removed), as
`SlicePlacementGroup.release_head_pgs` does: from then on each part holds its chips, and a part's later
reservation (a restart) reserves its own head.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tpuray.constants import SLICE_NAME_LABEL
from tpuray.slices import lending
from tpuray.slices.demand import head_request, slice_demand
from tpuray.slices.inventory import format_slices, list_slices
from tpuray.slices.lending import Loan
from tpuray.slices.placement import SliceReservationTimeout
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError, check_positive_int, is_number

logger = logging.getLogger(__name__)


class SliceClaim:
    """The heads of `shapes` ((topology, number of slices) pairs) in one placement group (module doc).
    Construction validates; `open()` reserves, waiting at most `timeout_s` (None: forever), and raises
    SliceReservationTimeout with nothing held when Ray cannot place every head."""

    def __init__(
        self, shapes: Sequence[tuple[SliceTopology, int]], timeout_s: float | None = 120.0, name: str = ""
    ) -> None:
        if not shapes:
            raise ConfigError("a SliceClaim needs at least one (topology, num_slices) shape")
        for topo, count in shapes:
            if not isinstance(topo, SliceTopology):
                raise ConfigError(f"a SliceClaim shape's topology must be a SliceTopology, got {topo!r}")
            check_positive_int("num_slices", count)
        if timeout_s is not None and (not is_number(timeout_s) or timeout_s <= 0):
            raise ConfigError(f"timeout_s must be a number > 0 or None (wait forever), got {timeout_s!r}")
        wanted: dict[str, tuple[SliceTopology, int]] = {}
        for topo, count in shapes:  # one entry per pod type: the same shape twice is one shape, summed
            wanted[topo.pod_type] = (topo, wanted.get(topo.pod_type, (topo, 0))[1] + count)
        self.shapes = list(wanted.values())
        self.timeout_s = timeout_s
        self.name = name
        self.pod_types = [topo.pod_type for topo, _ in self.shapes]
        self._pg: Any = None  # the heads' placement group, while open
        self._pods: list[str] = []  # the pod type of each bundle, in bundle order
        self._lent: set[int] = set()  # bundles a SlicePlacementGroup holds now
        self._placed: set[int] = set()  # bundles whose borrower's chips are reserved
        self._term = 0  # +1 per open(): a loan of an earlier opening refers to a removed placement group

    @property
    def is_open(self) -> bool:
        """Holding its heads: opened, and not every claimed slice reserved by a borrower yet."""
        return self._pg is not None

    @property
    def slice_names(self) -> list[str]:
        """The claimed slices, in bundle order (shapes in the order given)."""
        return [name for name, _ in self._heads()]

    def open(self) -> SliceClaim:
        import ray
        from ray.util.placement_group import placement_group

        if self._pg is not None:
            return self
        if not ray.is_initialized():
            raise RuntimeError("SliceClaim needs a Ray connection: call ray.init() first")
        request = head_request(list(self.shapes), slice_demand())  # the heads first, in shape order
        self._pods = [topo.pod_type for topo, count in self.shapes for _ in range(count)]
        self._pg = placement_group(
            request.bundles,
            strategy=request.strategy,
            name=self.name,
            bundle_label_selector=request.selectors,
        )
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        except BaseException:
            self.close()
            raise
        if not ready:
            self.close()
            wanted = ", ".join(f"{n} x {t.generation.accelerator_type} {t.topology}" for t, n in self.shapes)
            raise SliceReservationTimeout(
                f"could not claim {wanted} at once within {self.timeout_s}s; nothing is held. TPU slices "
                f"in this cluster:\n{format_slices(list_slices())}"
            )
        with lending.LOCK:
            self._term += 1
            lending.OPEN.append(self)
        logger.info("claimed slices %s", self.slice_names)
        return self

    def close(self) -> None:
        """Release the claim's placement group (lent heads go with it). Idempotent."""
        from ray.util.placement_group import remove_placement_group

        with lending.LOCK:
            if self in lending.OPEN:
                lending.OPEN.remove(self)
            pg, self._pg, self._pods, self._lent, self._placed = self._pg, None, [], set(), set()
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:
                logger.exception("failed to remove the slice claim's placement group %s", pg.id)

    def __enter__(self) -> SliceClaim:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _heads(self) -> list[tuple[str, dict[str, float]]]:
        """(slice name, head node resources) per bundle; ("", {}) for a bundle not placed now."""
        import ray
        from ray.util.placement_group import placement_group_table

        if self._pg is None:
            return []
        placed = placement_group_table(self._pg).get("bundles_to_node_id") or {}
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        out = []
        for index in range(len(self._pods)):
            node = nodes.get(placed.get(index, ""))
            labels = (node or {}).get("Labels") or {}
            out.append((labels.get(SLICE_NAME_LABEL, ""), dict((node or {}).get("Resources") or {})))
        return out

    # -- lending.Lender ------------------------------------------------------------------------------
    def lend(self, pod_type: str, count: int) -> Loan | None:
        """`count` heads of `pod_type` not lent, each on a placed, whole, not draining slice; marked lent
        (lending.LOCK held)."""
        if pod_type not in self.pod_types:
            return None
        healthy = {s.name for s in list_slices() if s.intact and not s.draining}
        heads = [
            (index, name, resources)
            for index, (name, resources) in enumerate(self._heads())
            if self._pods[index] == pod_type and index not in self._lent and name in healthy
        ][:count]
        if len(heads) < count:
            return None
        self._lent.update(index for index, _, _ in heads)
        return Loan(self, [h[0] for h in heads], [h[1] for h in heads], [h[2] for h in heads], self._term)

    def _current(self, loan: Loan) -> bool:
        """Whether `loan` was lent by this opening (lending.LOCK held)."""
        return self._pg is not None and loan.term == self._term

    def returned(self, loan: Loan) -> None:
        with lending.LOCK:
            if self._current(loan):
                self._lent.difference_update(loan.indices)

    def placed(self, loan: Loan) -> None:
        """Once every claimed slice's chips are reserved by a borrower, let go of the heads (close())."""
        with lending.LOCK:
            if not self._current(loan):
                return
            self._placed.update(loan.indices)  # _current: still open
            done = self._placed >= set(range(len(self._pods)))
        if done:
            self.close()

    def __repr__(self) -> str:
        state = f"slices={self.slice_names}" if self._pg is not None else "closed"
        wanted = ", ".join(f"{n} x {t.pod_type}" for t, n in self.shapes)
        return f"SliceClaim({wanted}, {state})"
