"""Model execution: `ModelRunner` (one shard + its KV cache) and `EngineWorker`, the per-chip Ray actor.

A step is a list of `(slot, new_token_ids, start_position)`; prompts (several tokens) and decodes (one
token) run as two batched forwards. Every rank runs the same step (the all_reduces pair up); rank 0
returns the logits of each sequence's last token, other ranks return None.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

from tpuray.serve.llm.engine.model import ShardedLlama

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


class EngineWorker:
    """Ray actor body (wrapped with `ray.remote` by the engine): one tensor-parallel rank on one chip."""

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None

    def describe(self) -> dict[str, Any]:
        """Where Ray placed this worker: node ip, its slice rank and TPU process env (from tpuray.isolation)."""
        import ray

        info: dict[str, Any] = {"node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}
        if os.environ.get("TPU_ACCELERATOR_TYPE"):
            from tpuray.isolation import process_env

            env = process_env()
            info.update(
                env=env,
                rank=int(env["CLOUD_TPU_TASK_ID"]),
                local_rank=int(env["TPU_VISIBLE_CHIPS"].split(",")[0]),
            )
        return info

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(
        self,
        path: str,
        rank: int,
        world_size: int,
        master: tuple[str, int] | None,
        env: dict,
        engine_kwargs: dict,
    ) -> dict:
        os.environ.update(env)
        device = "cpu"
        all_reduce = None
        if os.environ.get("TPU_ACCELERATOR_TYPE"):
            from tpuray.runtime import activate

            mode = activate()
            device = "tpu"
            logger.info("engine worker rank %d/%d on tpu (%s)", rank, world_size, mode)
        if world_size > 1:
            import torch.distributed as dist

            os.environ.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master[0], MASTER_PORT=str(master[1])
            )
            backend = "tpu_dist" if device == "tpu" else "gloo"
            dist.init_process_group(backend=backend)
            all_reduce = dist.all_reduce
        self.runner = ModelRunner(
            path,
            max_num_seqs=engine_kwargs["max_num_seqs"],
            max_model_len=engine_kwargs["max_model_len"],
            dtype=engine_kwargs.get("dtype", "auto"),
            rank=rank,
            world_size=world_size,
            device=device,
            all_reduce=all_reduce,
        )
        from tpuray.runtime import is_emulated

        return {
            "rank": rank,
            "device": str(self.runner.device),
            "emulated": is_emulated(),
            "pid": os.getpid(),
        }

    def step(self, batch: Step) -> torch.Tensor | None:
        return self.runner.step(batch)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
