"""Emulated TPU slices on real Ray nodes (every emulated node is labelled `tpuray.io/emulated=true`).

`import tpuray.emulator` stays cheap: Ray is imported when a cluster starts.
"""

from tpuray.emulator.cluster import EmulatedCluster
from tpuray.emulator.spec import (
    EMULATED_LABEL,
    EMULATION_ENV,
    EmulatedSlice,
    HostSpec,
    SliceRequest,
    host_specs,
    plan_slices,
)

__all__ = [
    "EMULATED_LABEL",
    "EMULATION_ENV",
    "EmulatedCluster",
    "EmulatedSlice",
    "HostSpec",
    "SliceRequest",
    "host_specs",
    "plan_slices",
]
