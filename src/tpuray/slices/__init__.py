"""Whole-slice TPU reservations on Ray placement groups, and the cluster's slice inventory."""

from tpuray.slices.inventory import SliceInfo, format_slices, list_slices
from tpuray.slices.placement import SlicePlacementGroup, SliceReservationTimeout, slice_placement_group

__all__ = [
    "SliceInfo",
    "SlicePlacementGroup",
    "SliceReservationTimeout",
    "format_slices",
    "list_slices",
    "slice_placement_group",
]
