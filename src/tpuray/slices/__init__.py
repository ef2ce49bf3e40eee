"""Whole-slice TPU reservations on Ray placement groups, the cluster's slice inventory, and the per-chip
worker group that training and serving share."""

from tpuray.slices.claim import SliceClaim
from tpuray.slices.distributed import RankInfo
from tpuray.slices.drain import DrainWatch, PreemptionInfo, draining_nodes
from tpuray.slices.group_start import LostWhileStarting, start_group
from tpuray.slices.inventory import (
    SliceInfo,
    format_slices,
    holder_name,
    list_slices,
    pending_slice_demand,
)
from tpuray.slices.placement import SlicePlacementGroup, SliceReservationTimeout, slice_placement_group
from tpuray.slices.worker import SliceWorker, WorkerPlacement
from tpuray.slices.worker_group import PlacementError, SliceWorkerGroup, WorkerGroupSpec, assign_ranks

__all__ = [
    "DrainWatch",
    "PreemptionInfo",
    "draining_nodes",
    "LostWhileStarting",
    "PlacementError",
    "RankInfo",
    "SliceClaim",
    "SliceInfo",
    "SlicePlacementGroup",
    "SliceReservationTimeout",
    "SliceWorker",
    "SliceWorkerGroup",
    "WorkerGroupSpec",
    "WorkerPlacement",
    "assign_ranks",
    "format_slices",
    "holder_name",
    "list_slices",
    "pending_slice_demand",
    "slice_placement_group",
    "start_group",
]
