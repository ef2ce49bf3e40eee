"""DDP on the emulated ``tpu`` device without c10d's "Time stats" warning.

From its second iteration on, DDP samples runtime stats (forward, backward and communication times)
through c10d's C++ ``Logger.set_runtime_stats_and_log``, which times only devices with a C++ timer
registered (CPU and CUDA). For any other device it prints, once per process and through c10's own
``LOG(WARNING)`` (not Python's ``warnings``, so no filter reaches it), "Time stats are currently only
collected for CPU and CUDA devices. Please refer to CpuTimer or CudaTimer ...": 16 lines on a 4x4 slice.
A timer cannot be registered from Python, so on the emulated device DDP's logger skips that sampling
(it would record nothing) and forwards everything else (construction data, errors,
``_get_ddp_logging_data``).

:func:`install` is called once by :mod:`tpuray.runtime` when it activates the emulation, so it covers
every DistributedDataParallel built on the ``tpu`` device in that process: tpuray's ``prepare_model``,
Ray Train's and a user's own. DDP on other devices, and real TorchTPU, are left alone.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("tpuray.runtime")

_DEVICE_TYPE = "tpu"


class NoRuntimeStatsLogger:
    """DDP's C++ logger minus runtime-stats sampling; every other attribute comes from ``wrapped``."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    def set_runtime_stats_and_log(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def install() -> None:
    """Wrap the logger of every DDP on the ``tpu`` device built from now on (idempotent).

    The hook is ``DistributedDataParallel._ddp_init_helper``, where DDP creates its reducer and logger
    (at construction and when unpickled). A torch without it keeps the warning, nothing else changes.
    """
    from torch.nn.parallel import DistributedDataParallel

    helper = getattr(DistributedDataParallel, "_ddp_init_helper", None)
    if helper is None:
        log.debug("tpuray: torch's DDP has no _ddp_init_helper; its time-stats warning stays on tpu")
        return
    if getattr(helper, "_tpuray_quiet", False):
        return

    @functools.wraps(helper)
    def _ddp_init_helper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = helper(self, *args, **kwargs)
        logger = getattr(self, "logger", None)
        if (
            getattr(self, "device_type", None) == _DEVICE_TYPE
            and logger is not None
            and not isinstance(logger, NoRuntimeStatsLogger)
        ):
            self.logger = NoRuntimeStatsLogger(logger)
        return result

    _ddp_init_helper._tpuray_quiet = True  # type: ignore[attr-defined]
    DistributedDataParallel._ddp_init_helper = _ddp_init_helper  # type: ignore[method-assign]
