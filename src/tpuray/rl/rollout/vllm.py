"""`VLLMRolloutEngine`: `RolloutEngine`'s API (generate, update_weights, sleep / wake_up, shutdown) over
vLLM's engine, what `tpuray.rl.rollout_engine(config)` returns where `config.resolved_engine` is "vllm".

vLLM starts as a serving replica starts it (`tpuray.serve.llm.engine.vllm.VLLMEngine`: vLLM's AsyncLLM,
on this machine's CPU or on a TPU slice it reserves atomically, one vLLM worker per chip, tpuray's
emulated-TPU platform plugin on emulated slices), with tpuray's worker extension
(`tpuray.rl.rollout.vllm_worker.WeightsExtension`) in every worker; generation goes straight to AsyncLLM (no
HTTP). `update_weights` checks the state dict on the driver, then `collective_rpc` stages it on every
rank (checked again there) and, only when all staged, loads it in place (vLLM's `reload_weights`), then
resets vLLM's prefix cache (its KV blocks were computed with the old weights).

sleep / wake_up use vLLM's sleep mode where the platform has one (`is_sleep_mode_available()`: CUDA,
ROCm, XPU); on vLLM's CPU backend (the CPU build, and emulated TPU slices) they raise
`SleepModeUnavailable` naming the platform. vLLM's engine core is a child process (multiprocessing
spawn): a script that starts one needs the `if __name__ == "__main__":` guard, and should `shutdown()`
the engine (or use `with`): a client of a dead engine core can hang at garbage collection.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.rollout.engine import RolloutEngine, lost_update
from tpuray.rl.rollout.protocol import GenerationEngine
from tpuray.rl.rollout.vllm_worker import EXTENSION, LOST, pack_state
from tpuray.rl.sync.collective import Channel
from tpuray.rl.sync.driver import on_this_node
from tpuray.rl.sync.update import TrainerUpdate
from tpuray.rl.weights.check import WeightMismatchError, check_state, shapes_of
from tpuray.serve.llm.engine.vllm.engine import VLLMEngine
from tpuray.serve.llm.generation import PromptEncoder, SamplingParams, SeqOutput

logger = logging.getLogger(__name__)

_NOT_VLLM = ("grammar",)  # tpuray SamplingParams fields vLLM's SamplingParams has not (by that name)


class SleepModeUnavailable(RuntimeError):
    """vLLM's sleep mode does not exist on this platform (vLLM's CPU backend has none)."""


class _RolloutVLLMEngine(VLLMEngine):
    """Serving's VLLMEngine with tpuray's worker extension, sleep mode where the platform has it, and
    eager execution on vLLM's CPU backend (no torch.compile start-up on a CPU)."""

    sleep_mode = False  # set by _start (run from VLLMEngine.__init__)
    platform = ""  # vLLM's platform class name, set by _start

    def _start(self, path: str, ray_address: str | None) -> None:
        from vllm.platforms import current_platform

        self._clear_platform_cache()  # the emulated-TPU env (set by _reserve) decides the platform
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.platform = type(current_platform).__name__
        self.engine_args["worker_extension_cls"] = EXTENSION
        self.engine_args["enable_sleep_mode"] = self.sleep_mode
        if current_platform.is_cpu():
            self.engine_args.setdefault("enforce_eager", True)
        super()._start(path, ray_address)


def vllm_params(params: SamplingParams, index: int) -> Any:
    """tpuray's SamplingParams as vLLM's (every field by name; one vLLM has not is refused when set).
    A seeded sample `index` of the batch (prompts expanded by n) draws with seed + index: repeated prompts
    of a seeded batch give distinct samples."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    default = SamplingParams()
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name in _NOT_VLLM:
            if value != getattr(default, f.name):
                raise ValueError(f"SamplingParams.{f.name} is not supported by the vLLM rollout engine")
            continue
        kwargs[f.name] = value
    if params.seed is not None:
        kwargs["seed"] = params.seed + index
    return vllm.SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)


def stage_refusal(staged: list[Any], version: int) -> Exception | None:
    """What the vLLM ranks' stage results say (tpuray.rl.rollout.vllm_worker): None when every rank staged;
    else the UpdateLostError of pieces lost with their sender, or the WeightMismatchError a rank returned."""
    refused = [r for r in staged if isinstance(r, str)]  # a worker's WeightMismatchError, returned
    lost = [r[1] for r in staged if isinstance(r, list | tuple) and r and r[0] == LOST]
    if lost:
        return lost_update(version, lost[0])
    if refused:
        return WeightMismatchError(refused[0])
    return None


class VLLMGeneration(PromptEncoder):
    """`GenerationEngine` over vLLM's AsyncLLM (one final output per sequence)."""

    runner = None  # no in-process ModelRunner, no SliceWorkerGroup: vLLM runs its own workers
    group = None

    def __init__(self, config: RolloutConfig) -> None:
        from transformers import AutoTokenizer

        self.vllm = _RolloutVLLMEngine(config.llm_config, reservation_timeout_s=config.reservation_timeout_s)
        self._ids = itertools.count()  # this engine's request ids
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.vllm.args.model)
        except BaseException:
            self.vllm.shutdown()
            raise

    @property
    def max_model_len(self) -> int:
        return self.vllm.max_model_len

    @property
    def client(self) -> Any:
        if self.vllm.client is None:
            raise RuntimeError("the vLLM rollout engine is shut down")
        return self.vllm.client

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, index: int = 0
    ) -> AsyncIterator[Any]:
        from vllm.inputs import TokensPrompt

        final = None
        request = TokensPrompt(prompt_token_ids=prompt_ids)
        async for out in self.client.generate(
            request, vllm_params(params, index), f"rollout-{next(self._ids)}"
        ):
            final = out
        assert final is not None  # FINAL_ONLY: one output, when the sequence ended
        seq = final.outputs[0]
        chosen: list[tuple[int, float, list[tuple[int, float]]]] = [
            (t, lps[t].logprob, []) for t, lps in zip(seq.token_ids, seq.logprobs or [], strict=False)
        ]
        yield SeqOutput(seq.text, list(seq.token_ids), True, seq.finish_reason, logprobs=chosen)

    def describe(self) -> dict[str, Any]:
        return {**self.vllm.describe(), "sleep_mode": self.vllm.sleep_mode}

    def shutdown(self) -> None:
        self.vllm.shutdown()


class _PieceHolder:
    """A rank -> (ObjectRefs or Offers, tpu_dist Channel or None) board for one TrainerUpdate (a named Ray
    actor, no CPU): vLLM's workers look it up by name and take their rank's entry, so the refs travel
    through Ray (borrowed) and the offers need no msgpack encoding, not through vLLM's RPC."""

    def __init__(self) -> None:
        self.refs: list[list[Any]] | None = None
        self.channel: Channel | None = None

    def put(self, refs: list[list[Any]] | None, channel: Channel | None = None) -> None:
        self.refs, self.channel = refs, channel

    def get(self, rank: int) -> tuple[list[Any], Channel | None]:
        if self.refs is None:
            raise RuntimeError("no update is being staged")
        return self.refs[rank], self.channel


class VLLMRolloutEngine(RolloutEngine):
    """`RolloutEngine` over vLLM (see the module docstring); made by `tpuray.rl.rollout_engine(config)`
    where `config.resolved_engine` is "vllm"."""

    updates_while_asleep = False  # refused asleep: after sleep(level=2), wake_up, then update_weights

    _engine: VLLMGeneration
    _pieces: Any = None  # the _PieceHolder actor, made at the first TrainerUpdate
    _pieces_name = ""

    def _start_engine(self, config: RolloutConfig) -> GenerationEngine:
        return VLLMGeneration(config)

    def _check_update(self, update: Any) -> None:
        """A full state dict with Hugging Face names goes to every vLLM worker; a `TrainerUpdate` (an
        RLRun's trainer ranks, cut in vLLM's tensor-parallel layout: `tpuray.rl.weights.vllm_layout`) gives
        each worker only the pieces of its own part: pulled from the object store
        (weight_sync="object_store") or received over the update's tpu_dist group, which the worker joins
        (weight_sync="tpu_dist", `tpuray.rl.sync.collective`). Names and shapes are checked here and on
        each rank before any rank loads. `ShardedUpdate`s and bare ObjectRefs are the embedded engine's
        (`RolloutConfig(engine="embedded")`)."""
        if isinstance(update, TrainerUpdate):
            self._check_parallel(update)
        elif isinstance(update, Mapping):
            check_state(shapes_of(update), self.model_config)  # refused here, before any transfer
        else:
            raise WeightMismatchError(
                f"the vLLM rollout engine takes a state dict (name -> torch.Tensor) or a TrainerUpdate, got "
                f"{type(update).__name__}; ShardedUpdate / ObjectRef updates need engine='embedded'"
            )

    def _load_update(self, update: Any) -> int:
        if self._asleep:
            raise RuntimeError("RolloutEngine.update_weights while asleep (vLLM): call wake_up() first")
        args: tuple[Any, ...]
        try:
            if isinstance(update, TrainerUpdate):  # parked only once nothing else can refuse it
                method, args = "tpuray_stage_pieces", self._park(update)
            elif self._engine.vllm.in_process:  # the worker is in this process: tensors as they are
                method, args = "tpuray_stage_tensors", (dict(update),)
            else:
                method, args = "tpuray_stage_weights", (pack_state(update),)
            return self._loop.run(self._load(method, args))
        finally:
            self._drop_pieces()

    def _park(self, update: TrainerUpdate) -> tuple[str, str]:
        """Park each rank's ObjectRefs (or tpu_dist offers, with the group's channel) in a named holder
        actor, from which each vLLM worker (a Ray actor of vLLM's Ray executor) takes its own: only names
        pass vLLM's RPC, only a rank's pieces reach it.
        Returns (holder name, namespace), what the workers are given."""
        import ray

        if self._pieces is None:
            name = f"tpuray-vllm-pieces-{uuid.uuid4().hex[:12]}"
            self._pieces = (
                ray.remote(_PieceHolder)
                .options(name=name, num_cpus=0, scheduling_strategy=on_this_node())
                .remote()
            )
            self._pieces_name = name
        ray.get(self._pieces.put.remote([list(refs) for refs in update.refs], update.channel))
        return self._pieces_name, ray.get_runtime_context().namespace

    def _drop_pieces(self) -> None:
        import ray

        if self._pieces is not None:
            ray.get(self._pieces.put.remote(None))

    def shutdown(self) -> None:
        import ray

        holder, self._pieces = self._pieces, None
        if holder is not None:
            ray.kill(holder)
        super().shutdown()

    async def _load(self, method: str, args: tuple[Any, ...]) -> int:
        client = self._engine.client
        try:
            staged = await client.collective_rpc(method, args=args)
        except Exception:
            await client.collective_rpc("tpuray_discard_weights")
            raise
        refusal = stage_refusal(staged, self.version)
        if refusal is not None:
            await client.collective_rpc("tpuray_discard_weights")
            raise refusal
        written = int(sum(await client.collective_rpc("tpuray_commit_weights")))
        await client.reset_prefix_cache()  # KV blocks cached under the old weights must not be reused
        return written

    def _on_ranks(self, method: str, *args: Any) -> int:
        """vLLM's sleep (level 1: weights offloaded, KV cache dropped; level 2: weights discarded, to be
        replaced by update_weights after wake_up) / wake_up; vLLM does not report the bytes: 0."""
        if not self._engine.vllm.sleep_mode:
            raise SleepModeUnavailable(
                f"RolloutEngine.{method}: vLLM's sleep mode is not available on platform "
                f"{self._engine.vllm.platform} (vLLM's is_sleep_mode_available() is False: it frees device "
                "memory through the CUDA / ROCm / XPU allocator; the CPU backend, also on emulated TPU "
                "slices, has none). Use RolloutConfig(engine='embedded') to sleep there"
            )
        client = self._engine.client
        self._loop.run(client.sleep(level=args[0]) if method == "sleep" else client.wake_up())
        return 0
