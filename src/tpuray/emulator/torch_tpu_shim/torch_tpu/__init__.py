"""torch_tpu, EMULATED by tpuray: what Ray's own TPU code needs from torch_tpu, on emulated TPU hosts only.

This is not TorchTPU. tpuray's emulator puts this package on the import path (PYTHONPATH) of emulated
TPU hosts, and only where no real torch_tpu is installed, so that Ray 2.60's TPU paths
(`ray.train.torch.TorchTrainer(ScalingConfig(use_tpu=True))`: `import torch_tpu`,
`torch_tpu._loader.load()`) run unchanged. The `tpu` device and the `tpu_dist` backend behind it are
tpuray's CPU emulation (tpuray.runtime): real tensors, real cross-process reductions, no TPU hardware.
Anywhere else (TPURAY_EMULATION unset) `import torch_tpu` raises ImportError, as on a machine without it.
"""

import logging
import os

# Safe on every host this package can be imported on: the emulator puts it on the import path of
# processes that run tpuray's own interpreter (tpuray installed), tpuray.constants imports nothing, and
# `import torch` already imports tpuray (its backend entry point). Without tpuray this raises
# ModuleNotFoundError, an ImportError, as the guard below would.
from tpuray.constants import EMULATION_ENV

EMULATED = True  # tpuray.runtime.detect recognises this package by it (and by its location)
__version__ = "0.0.0+tpuray.emulated"

if os.environ.get(EMULATION_ENV) != "1":
    raise ImportError(
        f"this torch_tpu is tpuray's emulation and works only on emulated TPU hosts ({EMULATION_ENV}=1)"
    )

logging.getLogger("tpuray.runtime").info(
    "torch_tpu here is tpuray's EMULATION (CPU-backed tpu device, gloo-backed tpu_dist), not TorchTPU"
)

from torch_tpu import _loader  # noqa: E402

_loader.load()
