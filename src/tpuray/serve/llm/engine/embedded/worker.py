"""`EngineWorker`: the embedded engine's per-chip Ray actor (a `tpuray.slices.SliceWorker`) around one
`ModelRunner` (runner.py): one tensor-parallel rank of the model.
"""

from __future__ import annotations

import logging
import os

from tpuray.constants import TPU_ACCELERATOR_TYPE_ENV
from tpuray.serve.llm.engine.embedded.runner import Launched, ModelRunner, StepResult
from tpuray.serve.llm.engine.embedded.step_plan import Step
from tpuray.slices.worker import SliceWorker

logger = logging.getLogger(__name__)


class EngineWorker(SliceWorker):
    """One tensor-parallel rank on one chip share: a Ray actor started by `SliceWorkerGroup`, which has
    already installed its process env (RANK, WORLD_SIZE, TPU env) and process group."""

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None
        self.launched: dict[int, Launched] = {}  # steps launched and not yet collected, by step id

    def load(self, path: str, engine_kwargs: dict) -> dict:
        """Load this rank's shard of the model; returns where it runs."""
        import torch.distributed as dist

        from tpuray.runtime import is_emulated

        device = "cpu"
        if os.environ.get(TPU_ACCELERATOR_TYPE_ENV):  # a TPU host, real or emulated
            from tpuray.runtime import activate

            mode = activate()
            device = "tpu"
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.runner = ModelRunner(
            path,
            max_num_seqs=engine_kwargs["max_num_seqs"],
            max_model_len=engine_kwargs["max_model_len"],
            dtype=engine_kwargs.get("dtype", "auto"),
            rank=rank,
            world_size=world_size,
            device=device,
            all_reduce=dist.all_reduce if world_size > 1 else None,
        )
        compiled = self.runner.warmup()  # before the replica reports ready: serving never compiles
        if device == "tpu":
            logger.info(
                "engine worker rank %d/%d on tpu (%s); %d programs compiled, %d loaded in %.1f s (backend %s)",
                rank,
                world_size,
                mode,
                compiled,
                self.runner.loaded_programs,
                self.runner.warmup_s,
                self.runner.backend,
            )
        import ray

        return {
            "rank": rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "model_path": path,
            "device": str(self.runner.device),
            "emulated": is_emulated(),
            "pid": os.getpid(),
            "compiled_programs": self.runner.compilations,
            "loaded_programs": self.runner.loaded_programs,
            "compiled": self.runner.compiled,
            "compile_backend": self.runner.backend,
        }

    def _loaded(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("EngineWorker step before load()")
        return self.runner

    def step(self, batch: Step, need_logits: bool = True) -> StepResult | None:
        return self._loaded().step(batch, need_logits)

    def launch(self, step_id: int, batch: Step, need_logits: bool = True) -> None:
        """Start step `step_id` (ids increase); `collect(step_id)` reads it back."""
        self.launched[step_id] = self._loaded().launch(batch, need_logits)

    def collect(self, step_id: int) -> StepResult | None:
        """Read step `step_id` back; earlier steps not collected (an engine loop cancelled between
        the two calls) are dropped."""
        for old in [i for i in self.launched if i < step_id]:
            del self.launched[old]
        return self._loaded().collect(self.launched.pop(step_id))
