"""torch's ``torch.backends`` entry point (called at the end of every ``import torch``).

With ``TPURAY_EMULATION=1`` (set by the emulator on every emulated TPU host) and no usable real
TorchTPU, it registers the emulated ``tpu`` device and ``tpu_dist`` backend. Otherwise it only
registers a ``tpu_dist`` stub whose error explains how to get one (unless torch_tpu is installed).
Must stay cheap and must never make ``import torch`` fail.
"""

from __future__ import annotations

import logging
import os

from tpuray.constants import EMULATION_ENV

log = logging.getLogger("tpuray.runtime")


def autoload() -> None:
    try:
        from tpuray import runtime

        if os.environ.get(EMULATION_ENV) == "1":
            runtime._activate_from_autoload()
        else:
            runtime._register_stub()
    except Exception as err:  # never break `import torch`
        log.warning("tpuray: could not set up the tpu device / tpu_dist backend: %s", err)
