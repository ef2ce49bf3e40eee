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
from tpuray.serve.llm.engine.logits import TokenLogprobs, token_logprobs
from tpuray.serve.llm.engine.model import ShardedLlama
from tpuray.slices.worker import SliceWorker

logger = logging.getLogger(__name__)

Step = list[
    tuple[int, list[int], int, int | None]
]  # (slot, new token ids, start position, prompt logprobs n)
PromptLogprobs = dict[int, list[TokenLogprobs]]  # batch index -> logprobs of prompt tokens 1.. (echo)

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

    def _forward(self, group: Step, all_positions: bool = False) -> torch.Tensor:
        T = max(len(ids) for _, ids, _, _ in group)
        tokens = torch.zeros(len(group), T, dtype=torch.long)
        for i, (_, ids, _, _) in enumerate(group):
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        dev = self.device
        return self.model.forward(
            tokens.to(dev),
            torch.tensor([s for _, _, s, _ in group], dtype=torch.long).to(dev),
            torch.tensor([len(ids) for _, ids, _, _ in group], dtype=torch.long).to(dev),
            torch.tensor([slot for slot, _, _, _ in group], dtype=torch.long).to(dev),
            self.cache,
            all_positions=all_positions,
        )

    def step(self, batch: Step) -> tuple[torch.Tensor, PromptLogprobs] | None:
        """Rank 0: logits [len(batch), vocab] (float32, CPU) of each sequence's last token, in batch order,
        and the prompt logprobs of prefills that asked for them; other ranks: None."""
        wants_prompt = [i for i, (_, ids, _, n) in enumerate(batch) if len(ids) > 1 and n is not None]
        prefill = [i for i, (_, ids, _, n) in enumerate(batch) if len(ids) > 1 and n is None]
        decode = [i for i, (_, ids, _, _) in enumerate(batch) if len(ids) == 1]
        out = torch.empty(len(batch), self.model.vocab_size)
        prompt_lps: PromptLogprobs = {}
        for idx in (prefill, decode):
            if idx:
                logits = self._forward([batch[i] for i in idx])
                if self.rank == 0:
                    out[idx] = logits.float().cpu()
        for i in wants_prompt:  # one at a time: every position's logits, not only the last
            _, ids, _, n = batch[i]
            logits = self._forward([batch[i]], all_positions=True)[0, : len(ids)]
            if self.rank == 0:
                full = logits.float().cpu()
                out[i] = full[-1]
                lp = torch.log_softmax(full[:-1], dim=-1)
                prompt_lps[i] = token_logprobs(lp, ids[1:], [n or 0] * (len(ids) - 1))
        return (out, prompt_lps) if self.rank == 0 else None

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
        import ray

        return {
            "rank": rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "model_path": path,
            "device": str(self.runner.device),
            "emulated": is_emulated(),
            "pid": os.getpid(),
        }

    def step(self, batch: Step) -> tuple[torch.Tensor, PromptLogprobs] | None:
        if self.runner is None:
            raise RuntimeError("EngineWorker.step before load()")
        return self.runner.step(batch)
