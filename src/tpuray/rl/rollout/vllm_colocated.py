"""Colocated vLLM (`RLConfig(placement="colocated")` with a vLLM `RolloutConfig`): vLLM runs inside the
trainer's own worker processes, one tensor-parallel rank per trainer rank (veRL's hybrid engine with vLLM).

A chip is opened by one process, so vLLM cannot start workers of its own on the trainer's slice. vLLM's
`external_launcher` executor is made for this: each trainer worker builds `vllm.LLM` in its process
(engine core in process, no child), with the trainer's default process group as vLLM's world, from which vLLM
makes its tensor-parallel group; the driver reaches each rank through Ray's `__ray_call__`
(`hosted.HostedGroup`; each rank, a `HostedVLLM`, owned by its worker actor). Every rank runs the same
`generate` over the same prompts (vLLM's external launcher needs identical, seeded requests on all ranks) and
rank 0's outputs are returned. Updates: each rank takes its own pieces of a `TrainerUpdate` (from the object
store, or over tpu_dist left in its process by its trainer rank: `tpuray.rl.sync.handover`), or all of a full
state dict put once, through tpuray's vLLM worker extension, called in process; then all commit (vLLM's
`reload_weights`).

sleep / wake_up: vLLM's own sleep mode where the platform has one; on vLLM's CPU backend (its CPU build
and emulated TPU slices), which has none, each rank frees its KV cache's memory itself (the cache
tensors keep their objects and shapes; their storage is emptied and retaken, and vLLM's prefix cache is
reset, since the blocks' contents are gone) and reports those bytes; the weights stay where the CPU
backend keeps them, in host memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.rollout.engine import Rollout, RolloutEngineError, host_state, is_state_dict
from tpuray.rl.rollout.hosted import ColocatedEngine, HostedGroup, host_rank, hosted_rank
from tpuray.rl.rollout.vllm import stage_refusal, vllm_params
from tpuray.rl.rollout.vllm_worker import EXTENSION
from tpuray.rl.sync.update import TrainerUpdate
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.serve.llm import model_source
from tpuray.serve.llm.engine.tpu_lowering import tracebacks_off
from tpuray.serve.llm.engine.tpu_programs import programs_loaded_lightly
from tpuray.serve.llm.engine.vllm.args import split_engine_kwargs
from tpuray.serve.llm.engine.vllm.cpu_shm import cpu_shm_names_of_this_run, release_cpu_shm
from tpuray.serve.llm.engine.vllm.engine import default_cpu_kv_cache
from tpuray.serve.llm.generation import PromptEncoder, SamplingParams

logger = logging.getLogger(__name__)

Generated = tuple[list[int], list[float], str, str | None]  # token ids, their logprobs, text, finish reason


class HostedVLLM:
    """`vllm.LLM` in this trainer worker's process, as tensor-parallel rank `dist.get_rank()`."""

    def __init__(self, path: str, engine_args: dict[str, Any]) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("colocated vLLM runs in a trainer worker, whose process group is vLLM's world")
        rank, world = dist.get_rank(), dist.get_world_size()
        # vLLM's external launcher reads the rank from the environment; its engine core stays in process
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        os.environ.setdefault("LOCAL_RANK", str(rank))
        from vllm import LLM
        from vllm.platforms import current_platform

        self.own_sleep = not current_platform.is_sleep_mode_available()
        default_cpu_kv_cache(engine_args)
        kwargs = {**engine_args, "tensor_parallel_size": world, "enable_sleep_mode": not self.own_sleep}
        shm_names: list[str] = []
        names: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if current_platform.is_cpu():
            kwargs.setdefault("enforce_eager", True)
            names = cpu_shm_names_of_this_run(shm_names)
        try:
            # its graphs lowered faster, loaded without copies (engine/tpu_lowering.py, tpu_programs.py)
            with names, tracebacks_off(), programs_loaded_lightly():
                self.llm = LLM(
                    path,
                    distributed_executor_backend="external_launcher",
                    worker_extension_cls=EXTENSION,
                    **kwargs,
                )
        finally:  # started: every rank has mapped them (vLLM's barrier); failed: nobody will
            release_cpu_shm(shm_names)
        self.rank = rank

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "max_model_len": self.llm.llm_engine.model_config.max_model_len}

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generated]:
        """Every rank generates the same batch (vLLM's external launcher) and returns what it sampled."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [vllm_params(p, i) for i, p in enumerate(params)],
            use_tqdm=False,
        )
        done: list[Generated] = []
        for out in outputs:
            seq = out.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(seq.token_ids, seq.logprobs or [], strict=False)]
            done.append((list(seq.token_ids), lps, seq.text, seq.finish_reason))
        return done

    def stage_pieces(self, refs: list[Any], channel: Any) -> int | str | list[str]:
        (staged,) = self.llm.collective_rpc("tpuray_stage_refs", args=(refs, channel))
        return staged

    def stage_weights(self, state: Mapping[str, Any]) -> int | str:
        """A full state dict's host tensors, handed to this rank's vLLM worker as they are: its engine core
        runs in this process, so `collective_rpc` passes them by reference (nothing packed or copied)."""
        (staged,) = self.llm.collective_rpc("tpuray_stage_tensors", args=(dict(state),))
        return staged

    def commit_weights(self) -> int:
        (written,) = self.llm.collective_rpc("tpuray_commit_weights")
        self.llm.reset_prefix_cache()  # KV blocks cached under the old weights must not be reused
        return int(written)

    def discard_weights(self) -> None:
        self.llm.collective_rpc("tpuray_discard_weights")

    def sleep(self, level: int = 1) -> int:
        """Bytes freed: vLLM's sleep (`level`) where the platform has it (vLLM does not say how much: 0);
        on the CPU backend this rank's KV cache memory (tpuray's worker extension; the weights stay in
        host memory at either level)."""
        if not self.own_sleep:
            self.llm.sleep(level=level)
            return 0
        (freed,) = self.llm.collective_rpc("tpuray_empty_kv_cache")
        return int(freed)

    def wake_up(self) -> int:
        if not self.own_sleep:
            self.llm.wake_up()
            return 0
        (retaken,) = self.llm.collective_rpc("tpuray_refill_kv_cache")
        self.llm.reset_prefix_cache()  # the cached blocks' contents are gone
        return int(retaken)

    def unload(self) -> None:
        from vllm.distributed.parallel_state import destroy_model_parallel

        del self.llm
        destroy_model_parallel()  # vLLM's groups; the trainer's default process group stays


def _on_host(actor: Any, method: str, *args: Any) -> Any:
    """Runs in a trainer worker (through `__ray_call__`): `method` of the `HostedVLLM` rank the worker
    hosts ("load" makes it, "unload" drops it)."""
    hosted = hosted_rank(actor)
    if method == "unload":
        host_rank(actor, None)
        if hosted is not None:
            hosted.unload()
        return None
    if method == "load":
        hosted = HostedVLLM(*args)
        host_rank(actor, hosted)
        return hosted.info()
    if hosted is None:
        raise RuntimeError(f"colocated vLLM: {method} before load")
    return getattr(hosted, method)(*args)


def disagreement(tokens: Sequence[Sequence[Sequence[int]]]) -> str | None:
    """`tokens[rank][i]`: prompt i's tokens as each rank sampled them. None where every rank has rank 0's
    tokens; else the first prompt and rank that differ, with both ranks' tokens."""
    for rank in range(1, len(tokens)):
        for i, (mine, first) in enumerate(zip(tokens[rank], tokens[0], strict=True)):
            if list(mine) != list(first):
                return f"prompt {i}: rank 0 {list(first)}, rank {rank} {list(mine)}"
    return None


class _HostedVLLMGeneration(PromptEncoder):
    """What `RolloutEngine` drives (GenerationEngine's info and shutdown): vLLM in the trainer's workers.
    Generation goes through `ColocatedVLLMEngine._generate_all` (one batch per call, on every rank)."""

    runner = None

    def __init__(self, config: RolloutConfig, hosts: Sequence[Any]) -> None:
        import ray
        from transformers import AutoTokenizer

        path = model_source.resolve(config.model_source)  # the same local path on the trainer's hosts
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        engine_args, _ = split_engine_kwargs(config.llm_config)
        engine_args.setdefault("seed", 0)  # every rank samples alike only with one seed
        self.group = HostedGroup(hosts, _on_host)
        try:
            info = ray.get(self.group.call("load", path, engine_args))
        except BaseException:
            self.group.shutdown()
            raise
        self._max_model_len = int(info[0]["max_model_len"])
        logger.info("vLLM colocated with the trainer: tensor_parallel_size=%d", len(info))

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, prompt_ids: list[int], params: SamplingParams, index: int = 0) -> Any:
        raise NotImplementedError("colocated vLLM generates whole batches (ColocatedVLLMEngine.generate)")
        yield  # an async generator, as GenerationEngine's

    def describe(self) -> dict[str, Any]:
        return {"engine": "vllm", "placement": "colocated", "tensor_parallel_size": self.group.world_size}

    def shutdown(self) -> None:
        self.group.shutdown()


class ColocatedVLLMEngine(ColocatedEngine):
    """`RolloutEngine`'s API over vLLM running in the trainer's workers `hosts` (their actor handles,
    rank order; see the module docstring). Made by `tpuray.rl.rollout_engine(config, hosts)` for a
    colocated vLLM run."""

    _engine: _HostedVLLMGeneration

    def _start_engine(self, config: RolloutConfig) -> _HostedVLLMGeneration:
        return _HostedVLLMGeneration(config, self._hosts)

    async def _generate_all(self, ids: list[list[int]], params: list[SamplingParams]) -> list[Rollout]:
        import ray

        results = ray.get(self._engine.group.call("generate", ids, params))  # the lock is held: one call
        self._check_agreed([[out[0] for out in rank] for rank in results])
        return [Rollout(list(p), *out) for p, out in zip(ids, results[0], strict=True)]

    def _check_agreed(self, tokens: list[list[list[int]]]) -> None:
        """Each rank samples on its own (vLLM's external launcher): where the ranks' tokens differ
        (`disagreement`), their tensor-parallel forward passes mixed different tokens (the batch is
        garbage) and their caches and schedules no longer agree: the engine is failed
        (RolloutEngineError; an RLRun ends, nothing left)."""
        apart = disagreement(tokens)
        if apart is None:
            return
        self.failure = RuntimeError(
            f"colocated vLLM's tensor-parallel ranks sampled different tokens for the same batch ({apart}); "
            "their random generators were not in step, so their KV caches no longer agree"
        )
        raise RolloutEngineError(
            f"{self.failure}. The engine cannot continue: shutdown() it and start a new one; a seeded "
            "SamplingParams(seed=...) gives every rank the same samples"
        ) from self.failure

    def _update_workers(self, update: Any) -> int:
        """An RLRun's TrainerUpdate (object store: each rank pulls its own pieces; tpu_dist: each takes the
        part its trainer rank left in its process, `tpuray.rl.sync.handover`) or a full state dict (checked on
        the driver already; put once, every rank stages all of it), then every rank commits."""
        import ray

        group = self._engine.group
        if isinstance(update, TrainerUpdate) and update.channel is None:
            staged = ray.get(group.call_each("stage_pieces", [(list(r), None) for r in update.refs]))
        elif is_state_dict(update):
            staged = ray.get(group.call("stage_weights", ray.put(host_state(update))))
        else:
            raise WeightMismatchError(
                "colocated vLLM takes a state dict (name -> torch.Tensor) or an RLRun's TrainerUpdate "
                f"(made colocated: no tpu_dist channel), got {type(update).__name__}"
            )
        refusal = stage_refusal(staged, self.version)
        if refusal is not None:
            ray.get(group.call("discard_weights"))
            raise refusal
        return sum(ray.get(group.call("commit_weights")))
