"""tpuray's vLLM platform plugin (the `vllm.platform_plugins` entry point): emulated TPU slices.

vLLM resolves its platform once per process (the serving replica, vLLM's engine core, each Ray worker)
from its built-in detectors and every installed platform plugin. This one activates only where tpuray
emulates TPU chips: on emulated TPU hosts (`TPURAY_EMULATION=1`, set by the emulator) and in a process
that serves on an emulated slice (`TPURAY_VLLM_PLATFORM=emulated-tpu`, set by tpuray's vLLM engine before
vLLM starts; its child processes inherit it). Elsewhere it returns None and vLLM keeps its own platform,
so on a real TPU VM vLLM-TorchTPU's plugin is the only one.

No vllm import here: vLLM calls this while it is still resolving its platform.
"""

from __future__ import annotations

import os

from tpuray.constants import EMULATION_ENV, VLLM_PLATFORM_ENV

EMULATED_TPU = "emulated-tpu"
PLATFORM = "tpuray.serve.llm.engine.vllm.emulated_platform.EmulatedTpuPlatform"


def emulated_tpu_requested() -> bool:
    return os.environ.get(VLLM_PLATFORM_ENV) == EMULATED_TPU or os.environ.get(EMULATION_ENV) == "1"


def register() -> str | None:
    """vLLM's platform-plugin hook: the platform's qualified name, or None when not emulating."""
    if not emulated_tpu_requested():
        return None
    from tpuray.runtime.detect import torch_tpu_usable

    if torch_tpu_usable():  # real TPU chips: vLLM's TPU platform serves them, never the emulation
        return None
    return PLATFORM
