"""Model execution: `ModelRunner` (one shard + its KV cache) and `EngineWorker`, the per-chip Ray actor
(a `tpuray.slices.SliceWorker`).

A step is a list of `(slot, new_token_ids, start_position)`; prompts (several tokens) and decodes (one
token) run as two batched forwards. Every rank runs the same step (the all_reduces pair up); rank 0
returns the logits of each sequence's last token, other ranks return None.
"""

from __future__ import annotations

import logging
import os

import torch

from tpuray.constants import TPU_ACCELERATOR_TYPE_ENV
from tpuray.serve.llm.engine.model import ShardedLlama
from tpuray.slices.worker import SliceWorker

logger = logging.getLogger(__name__)

Step = list[tuple[int, list[int], int]]  # (slot, new token ids, start position)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}


class ModelRunner:
    def __init__(
        self,
        path: str,
        *,
        max_num_seqs: int,
        max_model_len: int,
        dtype: str = "auto",
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        all_reduce=None,
    ):
        self.model = ShardedLlama(path, rank, world_size, DTYPES[dtype], device, all_reduce)
        self.rank = rank
        self.device = self.model.device
        self.cache = self.model.new_kv_cache(max_num_seqs, max_model_len)

    def _forward(self, group: Step) -> torch.Tensor:
        T = max(len(ids) for _, ids, _ in group)
        tokens = torch.zeros(len(group), T, dtype=torch.long)
        for i, (_, ids, _) in enumerate(group):
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        dev = self.device
        return self.model.forward(
            tokens.to(dev),
            torch.tensor([s for _, _, s in group], dtype=torch.long).to(dev),
            torch.tensor([len(ids) for _, ids, _ in group], dtype=torch.long).to(dev),
            torch.tensor([slot for slot, _, _ in group], dtype=torch.long).to(dev),
            self.cache,
        )

    def step(self, batch: Step) -> torch.Tensor | None:
        """Logits [len(batch), vocab] (float32, CPU) on rank 0, in batch order."""
        prefill = [i for i, (_, ids, _) in enumerate(batch) if len(ids) > 1]
        decode = [i for i, (_, ids, _) in enumerate(batch) if len(ids) == 1]
        out = torch.empty(len(batch), self.model.vocab_size)
        for idx in (prefill, decode):
            if idx:
                logits = self._forward([batch[i] for i in idx])
                if self.rank == 0:
                    out[idx] = logits.float().cpu()
        return out if self.rank == 0 else None

    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes


class EngineWorker(SliceWorker):
    """One tensor-parallel rank on one chip share: a Ray actor started by `SliceWorkerGroup`, which has
    already installed its process env (RANK, WORLD_SIZE, TPU env) and process group."""

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None

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
        if device == "tpu":
            logger.info("engine worker rank %d/%d on tpu (%s)", rank, world_size, mode)
        return {
            "rank": rank,
            "device": str(self.runner.device),
            "emulated": is_emulated(),
            "pid": os.getpid(),
        }

    def step(self, batch: Step) -> torch.Tensor | None:
        if self.runner is None:
            raise RuntimeError("EngineWorker.step before load()")
        return self.runner.step(batch)
