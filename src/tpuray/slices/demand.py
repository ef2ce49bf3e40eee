"""The first thing a slice reservation asks Ray for, which is all Ray's autoscaler sees of it.

A reservation (`SlicePlacementGroup`, a `SliceClaim`) first takes the head of each slice it wants
(`TPU-<pod type>-head`, a resource only worker 0 of a slice has), then every host of the slice its head
landed on (placement.py). Before any host of the shape runs, only the heads' placement group is pending,
and the autoscaler must read a whole slice into it. Two ways, chosen by `slice_demand()`:

- `"head"`: one bundle per slice, the head, selected by worker id 0 and pod type. Ray's v1 autoscaler
  (the emulator's slice provider: one autoscaler node is one whole slice) reads it as one slice.
- `"whole"`: the head selected by pod type alone, plus one companion bundle on each other host of the
  slice (`{"memory": 1}`: one byte, nothing a job asks for), all strictly spread. Ray's v2 autoscaler
  counts hosts, and its KubeRay provider turns hosts back into replicas rounding down (`hosts //
  numOfHosts`): a head alone is one host, no replica; a head and its companions are `numOfHosts` hosts,
  one replica, one slice. The worker-id selector goes because a KubeRay worker group's labels are the
  same on all its pods, so no group can declare it (docs/autoscaling-k8s.md); the head resource already
  means worker 0.

`TPURAY_SLICE_DEMAND` = `auto` (default: `whole` where Ray's v2 autoscaler runs, else `head`), `head`
or `whole`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, cast

from tpuray.constants import POD_TYPE_LABEL, SLICE_DEMAND_ENV, SLICE_NAME_LABEL, WORKER_ID_LABEL
from tpuray.slices.autoscaler import (
    SliceNodeType,
    published_node_types,
    published_slices,
    ray_autoscaler_runs,
)
from tpuray.slices.inventory import SliceInfo, known_slices, list_slices
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError, check_choice

logger = logging.getLogger(__name__)

SliceDemand = Literal["head", "whole"]
DEMAND_CHOICES = ("auto", "head", "whole")
# what a companion bundle holds on each other host of a slice: one byte of Ray's memory resource
COMPANION: dict[str, float] = {"memory": 1.0}


def slice_demand() -> SliceDemand:
    """`TPURAY_SLICE_DEMAND`, with `auto` resolved: `whole` where Ray's v2 autoscaler runs (its GCS flag),
    else `head`. A value outside auto/head/whole is a ConfigError naming it (requires ray.init())."""
    value = os.environ.get(SLICE_DEMAND_ENV, "auto")
    check_choice(SLICE_DEMAND_ENV, value, DEMAND_CHOICES)
    if value != "auto":
        return cast(SliceDemand, value)
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    try:
        return "whole" if is_autoscaler_v2() else "head"
    except Exception as e:  # e.g. no GCS client in this process: the demand every autoscaler had before
        logger.warning("cannot tell which Ray autoscaler runs (%s): %s=head", e, SLICE_DEMAND_ENV)
        return "head"


def check_slices_can_be_reserved(topo: SliceTopology, num_slices: int = 1) -> list[SliceInfo]:
    """Refuse at once a reservation of `num_slices` slices of `topo` that can never be placed, with a
    ConfigError naming the shape and what the cluster has (requires ray.init()):
    - where a slice autoscaler publishes its node types (autoscaler.py): more than the slices of that
      pod type started by hand plus the autoscaler's maximum for it;
    - on a fixed cluster (no autoscaler at all): more than the slices of that pod type it has had.
    Where Ray's own autoscaler runs (KubeRay), its node types decide: nothing is refused here and the
    reservation waits. Returns the slices of that pod type alive now."""
    same = [s for s in list_slices() if s.pod_type == topo.pod_type]
    types = published_node_types()
    if types is not None:
        problem = autoscaled_problem(topo, num_slices, same, types, published_slices())
    elif num_slices <= len(same):
        problem = None
    else:
        import ray

        problem = fixed_cluster_problem(topo, num_slices, known_slices(ray.nodes()))
        if problem is not None and ray_autoscaler_runs():
            problem = None
    if problem is not None:
        raise ConfigError(problem)
    return same


def _shape(topo: SliceTopology, num_slices: int) -> str:
    return f"{num_slices} x {topo.generation.accelerator_type} {topo.topology} (pod type {topo.pod_type})"


def autoscaled_problem(
    topo: SliceTopology,
    num_slices: int,
    same: list[SliceInfo],
    types: list[SliceNodeType],
    autoscaled: Mapping[str, object],
) -> str | None:
    """Why `num_slices` of `topo` can never come on a cluster whose slice autoscaler offers `types`
    (`same`: the slices of that pod type alive now; `autoscaled`: those the autoscaler runs), or None."""
    fixed = sum(1 for s in same if s.name not in autoscaled)
    if num_slices <= fixed + sum(t.max_slices for t in types if t.pod_type == topo.pod_type):
        return None
    return (
        f"{_shape(topo, num_slices)} can never be reserved here: this autoscaling emulated cluster has {fixed} "
        f"such slice(s) started by hand and its autoscaler's node types are: "
        f"{', '.join(t.describe() for t in types)}. Ask for one of those shapes, or start the cluster with "
        "--max-slices for this one"
    )


def fixed_cluster_problem(
    topo: SliceTopology, num_slices: int, known: Mapping[str, tuple[str, str, str]]
) -> str | None:
    """Why `num_slices` of `topo` can never come on a cluster with no autoscaler whose slices (alive or
    not: a lost host may be brought back) are `known` (`known_slices`), or None."""
    if num_slices <= sum(1 for *_, pod_type in known.values() if pod_type == topo.pod_type):
        return None
    acc = topo.generation.accelerator_type
    return (
        f"{_shape(topo, num_slices)} can never be reserved here: this Ray cluster has no autoscaler, and its "
        f"TPU slices are {describe_shapes(known.values())}. Ask for a shape it has, or add slices of this one "
        f"(on an emulated cluster: tpuray emulate up -a {acc} -t {topo.topology})"
    )


def describe_shapes(shapes: Iterable[tuple[str, str, str]]) -> str:
    """Slices counted by shape, from (accelerator type, topology, pod type) each: "2 x TPU-V6E 2x2
    (v6e-4), 1 x TPU-V5P 2x2x2 (v5p-16)", or "none"."""
    counts = Counter(shapes)
    return (
        ", ".join(f"{n} x {acc} {topo} ({pod})" for (acc, topo, pod), n in sorted(counts.items())) or "none"
    )


def free_slices(slices: list[SliceInfo]) -> list[str]:
    """The names of the slices a reservation may take whole now: every chip free, every host up, none
    draining."""
    return [s.name for s in slices if s.idle and s.intact and not s.draining]


@dataclass(frozen=True)
class HeadRequest:
    """One placement group's worth of slice heads: the heads first (in the order of the shapes asked
    for), then the companions of `"whole"` demand."""

    bundles: list[dict[str, float]]
    selectors: list[dict[str, str]]
    strategy: Literal["SPREAD", "STRICT_SPREAD"]
    idle: list[str]
    """The names of the slices whose chips were all free when asked (if enough of them, the heads and
    companions are restricted to those)."""


def head_request(shapes: list[tuple[SliceTopology, int]], demand: SliceDemand) -> HeadRequest:
    """The bundles that ask for the heads of `count` slices of each `(topology, count)` in `shapes`."""
    heads: list[tuple[dict[str, float], dict[str, str]]] = []
    companions: list[tuple[dict[str, float], dict[str, str]]] = []
    idle_all: list[str] = []
    for topo, count in shapes:
        selector = {POD_TYPE_LABEL: topo.pod_type}
        idle = free_slices(check_slices_can_be_reserved(topo, count))
        if len(idle) >= count:
            selector[SLICE_NAME_LABEL] = f"in({','.join(idle)})"
        head_selector = dict(selector) if demand == "whole" else {WORKER_ID_LABEL: "0", **selector}
        heads += [({topo.head_resource: 1.0}, head_selector)] * count
        if demand == "whole":
            companions += [(dict(COMPANION), selector)] * (count * (topo.num_hosts - 1))
        idle_all += idle
    both = heads + companions
    return HeadRequest(
        bundles=[dict(b) for b, _ in both],
        selectors=[dict(s) for _, s in both],
        strategy="STRICT_SPREAD" if companions else "SPREAD",
        idle=idle_all,
    )
