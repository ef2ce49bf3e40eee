"""tpuray: native PyTorch on TPU slices with Ray.

`import tpuray` stays cheap (no torch, no ray): torch imports `tpuray.runtime.autoload` through its
backend entry point on every `import torch`, which imports this package first. Public names are
resolved lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "SlicePlacementGroup": "tpuray.slices",
    "slice_placement_group": "tpuray.slices",
    "SliceTopology": "tpuray.topology",
    "EmulatedCluster": "tpuray.emulator",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tpuray' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
