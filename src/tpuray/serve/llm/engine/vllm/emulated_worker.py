"""`EmulatedTpuWorker`: vLLM's CPU worker on an emulated TPU slice, which leaves nothing in /dev/shm.

vLLM's CPU worker joins its tensor-parallel groups through shared-memory segments that vLLM never
removes (cpu_shm.py); once the worker's device and groups are up, every rank has mapped them, so their
names go.
"""

from __future__ import annotations

import os

from vllm.v1.worker.cpu_worker import CPUWorker

from tpuray.serve.llm.engine.vllm.cpu_shm import release_engine_cpu_shm


class EmulatedTpuWorker(CPUWorker):
    """vLLM's CPU worker (EmulatedTpuPlatform's), its groups' shared-memory names removed once joined."""

    def init_device(self) -> None:
        super().init_device()
        release_engine_cpu_shm(os.environ.get("VLLM_DIST_IDENT", ""))  # set by CPUWorker.init_device
