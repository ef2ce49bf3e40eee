"""`RolloutEngine`: batched generation for reinforcement learning, from Python (no HTTP), with weight
updates and sleep / wake-up: the API every rollout engine has. `tpuray.rl.rollout_engine(config)` makes
the one a `RolloutConfig` names (`factory`): `EmbeddedRolloutEngine` over tpuray's embedded engine
(`embedded`), `VLLMRolloutEngine` over vLLM (`vllm`), or, for a colocated `RLRun`, either in the trainer's
workers (`embedded_colocated`, `vllm_colocated`).

    engine = rollout_engine(RolloutConfig(model_dir, accelerator_type="TPU-V6E", topology="2x2"))
    rollouts = engine.generate(["1+2=", "3+4="], SamplingParams(max_tokens=8, temperature=1.0))
    engine.update_weights(policy.state_dict())      # checked against the engine's model first
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpuray.rl.config import RolloutConfig, SleepLevel
from tpuray.rl.rollout.protocol import GenerationEngine, check_sleep_level
from tpuray.rl.sync.update import TrainerUpdate
from tpuray.rl.weights.check import WeightMismatchError, check_state, shapes_of
from tpuray.rl.weights.cut import ShardedUpdate
from tpuray.serve.llm.generation import SamplingParams

logger = logging.getLogger(__name__)


NO_WEIGHTS = (
    "RolloutEngine.{what} after sleep(level=2): the weights were discarded and no update_weights loaded "
    "new ones since; call update_weights with the full state first (or sleep(level=1) to keep them)"
)


class RolloutEngineError(RuntimeError):
    """A rollout worker died (or its process group broke): the engine cannot generate or take weights
    any more; `shutdown()` it (which releases the slice) and start a new one."""


class UpdateLostError(RuntimeError):
    """An update's pieces were lost before every rollout worker had them (their sender, e.g. the trainer
    rank that put them in the object store or offered them over tpu_dist, died): nothing was loaded,
    the engine keeps its weights and can go on."""


def lost_update(version: int, why: str) -> UpdateLostError:
    """The UpdateLostError of an update whose pieces a rollout worker could not get (`why`: Ray's
    ObjectLostError, or tpu_dist's TransferError, as "Type: message") while the engine held weight
    version `version`."""
    return UpdateLostError(
        f"the update's pieces were lost before every rollout worker had them; the engine keeps its weights "
        f"(version {version}): {why}"
    )


def is_state_dict(update: Any) -> bool:
    """Whether an update is a state dict of tensors here (name -> tensor), not of ObjectRefs."""
    import ray

    return isinstance(update, Mapping) and not any(isinstance(v, ray.ObjectRef) for v in update.values())


def host_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict as the object store should carry it: each tensor detached, on the host, contiguous
    and owning exactly its bytes (torch pickles a view's whole storage: the chunks of a fused tensor
    would each carry all of it). Other values are left for the engine's check to refuse by name."""
    import torch

    out: dict[str, Any] = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor):
            t = t.detach().to("cpu").contiguous()
            if t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone()
        out[name] = t
    return out


@dataclass(frozen=True)
class Rollout:
    """One generated sequence: the prompt's and the completion's token ids, the log-probability of each
    completion token under the engine's current weights (the raw model distribution, before temperature
    and other processing), the completion's text and why it ended ("stop" or "length")."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class UpdateStats:
    """What one `update_weights` moved: bytes written into the engine's tensors over every rank, and
    seconds from the call to the last rank's commit."""

    bytes_written: int
    seconds: float
    version: int


class RolloutEngine:
    """Batched `generate`, `update_weights`, `sleep` / `wake_up` and `shutdown` over a generation engine
    (see the module docstring). Not thread-safe for concurrent calls: one call at a time (a lock). Made by
    `tpuray.rl.rollout_engine(config)`; each kind starts its engine (`_start_engine`) and loads updates
    into its ranks (`_update_workers`, or `_load_update` as a whole)."""

    updates_while_asleep = True  # update_weights works asleep (into the host copy): wake_up needs weights

    def __init__(self, config: RolloutConfig) -> None:
        if type(self) is RolloutEngine:
            raise TypeError(
                "RolloutEngine is the API every rollout engine has; make one with "
                "tpuray.rl.rollout_engine(config)"
            )
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"config must be a RolloutConfig, got {type(config).__name__}")
        self.config = config
        self.model_config: dict[str, Any] = config.model_config()
        self._lock = threading.Lock()
        self._loop = asyncio.Runner()
        self._asleep = False
        self._discarded = False  # slept at level 2 and no update loaded since: the weights are gone
        self._closed = False
        self.failure: BaseException | None = None  # a dead worker, ranks out of step: unusable
        self.version = 0  # weight updates committed
        try:
            self._engine: GenerationEngine = self._start_engine(config)
        except BaseException:
            self._loop.close()
            raise

    def _start_engine(self, config: RolloutConfig) -> GenerationEngine:
        """Start the generation engine this kind drives (reserving its slice where it has one)."""
        raise NotImplementedError

    # -- info ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def group(self) -> Any:
        """The engine's worker group: a slice's `SliceWorkerGroup`, the trainer's workers (colocated) or
        None (in this process, or vLLM's own workers)."""
        return self._engine.group

    @property
    def asleep(self) -> bool:
        return self._asleep

    def describe(self) -> dict[str, Any]:
        return {**self._engine.describe(), "weight_version": self.version, "asleep": self._asleep}

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"RolloutEngine.{what} after shutdown()")
        if self.failure is not None:
            raise RolloutEngineError(
                f"RolloutEngine.{what}: a rollout worker failed earlier ({type(self.failure).__name__}); "
                "shutdown() this engine and start a new one"
            ) from self.failure

    def _failed(self, e: BaseException) -> RolloutEngineError:
        self.failure = e
        return RolloutEngineError(
            f"a rollout worker of {self._engine.group!r} died ({type(e).__name__}: {e}); the engine cannot "
            "continue: shutdown() it and start a new one"
        )

    # -- generate -----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        n: int = 1,
    ) -> list[Rollout]:
        """`n` Rollouts per prompt (a text, tokenized without special tokens, or token ids), in order:
        prompt i's at [i * n, (i + 1) * n) (`n`: GRPO's group size, vLLM's SamplingParams.n). One
        SamplingParams for all or one per prompt; logprobs of the chosen tokens are always returned.
        Sample j of the batch draws with generator index j, so a seeded batch (repeated prompts, or
        n > 1) gives distinct, reproducible samples. A dead worker raises RolloutEngineError."""
        import ray

        self._check_open("generate")
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise TypeError(
                f"prompts must be a list of texts or token-id lists, got {type(prompts).__name__}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
        per_prompt = self._params(params, len(prompts))
        ids = [self._engine.encode_prompt(p if isinstance(p, str) else list(p)) for p in prompts]
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if len(p) >= self._engine.max_model_len:
                raise ValueError(
                    f"prompts[{i}] has {len(p)} tokens; max_model_len={self._engine.max_model_len} "
                    "leaves no room to generate"
                )
        ids = [p for p in ids for _ in range(n)]
        per_prompt = [sp for sp in per_prompt for _ in range(n)]
        with self._lock:
            if self._asleep:
                raise RuntimeError("RolloutEngine.generate while asleep: call wake_up() first")
            if self._discarded:
                raise RuntimeError(NO_WEIGHTS.format(what="generate"))
            try:
                return self._loop.run(self._generate_all(ids, per_prompt))
            except ray.exceptions.RayActorError as e:
                raise self._failed(e) from e

    @staticmethod
    def _params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * n
        else:
            per_prompt = list(params)
            if len(per_prompt) != n or not all(isinstance(p, SamplingParams) for p in per_prompt):
                raise ValueError(
                    f"params must be one SamplingParams or one per prompt ({n}); got {len(per_prompt)} items"
                )
        return [p if p.logprobs is not None else dataclasses.replace(p, logprobs=0) for p in per_prompt]

    async def _generate_all(self, ids: list[list[int]], params: list[SamplingParams]) -> list[Rollout]:
        return list(
            await asyncio.gather(
                *(self._generate_one(i, p, sp) for i, (p, sp) in enumerate(zip(ids, params, strict=True)))
            )
        )

    async def _generate_one(self, index: int, prompt: list[int], params: SamplingParams) -> Rollout:
        tokens: list[int] = []
        logprobs: list[float] = []
        text, reason = "", None
        async for out in self._engine.generate(prompt, params, index):
            tokens += out.token_ids
            logprobs += [lp for _, lp, _ in out.logprobs]
            text += out.text
            reason = out.finish_reason
        return Rollout(list(prompt), tokens, logprobs, text, reason)

    # -- weights ------------------------------------------------------------------------------------------
    def update_weights(self, update: Any) -> UpdateStats:
        """Load new weights: a full state dict with Hugging Face names (name -> tensor, e.g. a trainer's
        `model.state_dict()`) or a `TrainerUpdate` (`tpuray.rl.sync`: sent by the ranks of a
        `tpuray.train` run, each rank assembling its part from the pieces every trainer rank sent it);
        the embedded engine also takes a dict of name -> ObjectRef of a tensor, an ObjectRef of either, or
        a `ShardedUpdate` (`tpuray.rl.put_shards`, run where the state dict lives: each rank receives
        only its part). A pre-cut update's tensor_parallel_size must be the engine's.

        Every name and shape is checked against the engine's model before anything is written: a missing,
        unknown or misshapen tensor raises WeightMismatchError naming it and the expected shape, and the
        engine keeps its current weights. Tensors are cast to the engine's dtype. On a slice a state dict
        goes through Ray's object store (put once; every worker pulls it and keeps only its own
        tensor-parallel part)."""
        self._check_open("update_weights")
        start = time.perf_counter()
        self._check_update(update)
        with self._lock:
            written = self._load_update(update)
            self.version += 1
            self._discarded = False
        return UpdateStats(written, time.perf_counter() - start, self.version)

    def _check_update(self, update: Any) -> None:
        """Refuse an update before any transfer: a pre-cut one for another tensor-parallel size, a state
        dict whose names or shapes differ from the model's (WeightMismatchError)."""
        if isinstance(update, ShardedUpdate | TrainerUpdate):
            self._check_parallel(update)
        elif is_state_dict(update):
            check_state(shapes_of(update), self.model_config)

    def _load_update(self, update: Any) -> int:
        """Stage `update` on every rank, then commit it (all or nothing); the bytes written. Runs under the
        lock; a dead worker fails the engine (RolloutEngineError)."""
        import ray

        try:
            return self._update_workers(update)
        except ray.exceptions.RayActorError as e:
            raise self._failed(e) from e

    def _update_workers(self, update: Any) -> int:
        raise NotImplementedError

    def _check_parallel(self, update: ShardedUpdate | TrainerUpdate) -> None:
        """A pre-cut update must be cut for this engine's tensor-parallel size (WeightMismatchError)."""
        if update.tensor_parallel_size != self.tensor_parallel_size:
            raise WeightMismatchError(
                f"a {type(update).__name__} for tensor_parallel_size={update.tensor_parallel_size}; "
                f"this engine runs tensor_parallel_size={self.tensor_parallel_size}"
            )

    # -- sleep / wake-up ----------------------------------------------------------------------------------
    def sleep(self, level: SleepLevel = 1) -> int:
        """Free the chips' memory: the KV cache is dropped, and the weights copied to host memory first
        (level 1) or discarded (level 2, vLLM's meaning: for an engine whose next update replaces them all).
        Returns bytes freed over all ranks. `generate` needs `wake_up()`; `update_weights` still works
        (it updates the host copy; after level 2 the next `wake_up` needs one: RuntimeError otherwise)."""
        check_sleep_level(level)
        self._check_open("sleep")
        with self._lock:
            freed = self._on_ranks("sleep", level)
            self._asleep = True
            self._discarded = self._discarded or level == 2
            return freed

    def wake_up(self) -> int:
        """Retake the chips' memory and restore the weights; returns bytes retaken over all ranks."""
        self._check_open("wake_up")
        with self._lock:
            if self._discarded and self.updates_while_asleep:
                raise RuntimeError(NO_WEIGHTS.format(what="wake_up"))
            retaken = self._on_ranks("wake_up")
            self._asleep = False
            return retaken

    def _on_ranks(self, method: str, *args: Any) -> int:
        """`method` on every rank (sleep, wake_up): the sum of what they return."""
        import ray

        assert self._engine.group is not None
        try:
            return sum(ray.get(self._engine.group.call(method, *args)))
        except ray.exceptions.RayActorError as e:
            raise self._failed(e) from e

    # -- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine and its workers and release the slice. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            group = self._engine.group
            if group is not None and self.failure is not None:
                group.shutdown(
                    graceful=False
                )  # the live ranks may be stuck in a collective with the dead one
            self._engine.shutdown()
        finally:
            self._loop.close()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
