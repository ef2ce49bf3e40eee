"""`EmulatedTpuPlatform`: vLLM's CPU platform, scheduled like a TPU platform (emulated slices only).

Everything that computes is vLLM's own CPU backend (its CPU worker, attention kernels, gloo
communicator); what changes is how vLLM's Ray executor places its workers: one per chip, each asking Ray
for one `TPU` (`ray_device_key`), so tensor_parallel_size spans the per-chip bundles of the slice's
placement group, and Ray isolates each worker's chip through TPU_VISIBLE_CHIPS
(`device_control_env_var`), as vLLM-TorchTPU's platform does on a real slice. Its workers are vLLM's CPU
worker, less the shared memory that worker leaves behind (emulated_worker.py).
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform

from tpuray.constants import TPU_RESOURCE, TPU_VISIBLE_CHIPS_ENV

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
WORKER = "tpuray.serve.llm.engine.vllm.emulated_worker.EmulatedTpuWorker"


class EmulatedTpuPlatform(CpuPlatform):
    """vLLM's CPU backend in per-chip worker processes of an EMULATED TPU slice."""

    ray_device_key = TPU_RESOURCE
    device_control_env_var = TPU_VISIBLE_CHIPS_ENV
    emulated = True

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == CPU_WORKER:  # vLLM's default here; a worker_cls the user named stays
            parallel.worker_cls = WORKER
