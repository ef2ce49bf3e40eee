"""`RolloutWorker`: the embedded engine's per-chip actor (`EngineWorker`) plus weight updates and
sleep / wake-up. The same operations run on an in-process `ModelRunner` through `RunnerWeights`.

An update is two-phase so that a bad one changes nothing: `stage_weights` pulls the update from Ray's
object store, checks every name and shape and cuts this rank's shards (on the host); only when every rank
staged does `commit_weights` copy them into the model's tensors in place. `discard_weights` drops a
staged update.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tpuray.rl.rollout.protocol import check_sleep_level
from tpuray.rl.sync import handover
from tpuray.rl.sync.update import resolve_pieces
from tpuray.rl.weights import rows
from tpuray.rl.weights.check import WeightMismatchError, check_shards, check_state, shapes_of
from tpuray.rl.weights.cut import shard_state
from tpuray.rl.weights.join import assemble, copy_shards
from tpuray.rl.weights.layout import engine_tensors
from tpuray.serve.llm.engine.embedded.runner import ModelRunner
from tpuray.serve.llm.engine.embedded.worker import EngineWorker


def _is_ref(x: Any) -> bool:
    """Whether `x` is a Ray ObjectRef. None exists in a process that never imported Ray, so an in-process
    engine (a TPU VM's single process) takes its updates without Ray installed."""
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(x, ray.ObjectRef)


def resolve_update(update: Any) -> dict[str, torch.Tensor]:
    """An update as a state dict: a mapping of tensors, or of ObjectRefs to tensors (pulled here), or an
    ObjectRef to either (Ray resolves a top-level ref argument before the call)."""
    if _is_ref(update):
        update = sys.modules["ray"].get(update)
    if not isinstance(update, Mapping):
        raise WeightMismatchError(
            f"weight update must be a state dict (name -> tensor or ObjectRef), got {type(update).__name__}"
        )
    refs = {k: v for k, v in update.items() if _is_ref(v)}
    state = dict(update)
    if refs:
        state.update(zip(refs, sys.modules["ray"].get(list(refs.values())), strict=True))
    return state


class RunnerWeights:
    """Weight updates and sleep / wake-up of one `ModelRunner` (one tensor-parallel rank)."""

    def __init__(self, runner: ModelRunner, model_path: str | Path, rank: int, world_size: int) -> None:
        self.runner = runner
        self.config = json.loads((Path(model_path) / "config.json").read_text())
        self.rank, self.world_size = rank, world_size
        self.staged: dict[str, Any] | None = None  # shards: tensors, or rows.Rows of received pieces
        self.staged_owned = False  # the staged shards are the engine's to keep (a colocated hand-over)
        self.sleep_level = 0  # 0 awake; 1 asleep, weights on the host; 2 asleep, weights discarded
        # while asleep, what wake_up restores: the weights copied to the host (level 1), or an update
        # committed since (a host copy, or the handed-over shards themselves where they were made)
        self.restore: dict[str, torch.Tensor] | None = None
        self.shapes: _Holder | None = None  # while asleep: the weights' shapes and dtypes (meta tensors)
        self.freed: list[tuple[torch.Tensor, tuple[int, ...]]] = []  # while asleep: (tensor, shape)
        self.version = 0  # updates committed

    # -- weights ------------------------------------------------------------------------------------------
    def stage(self, update: Any) -> int:
        """Check the update and cut this rank's shards; returns the bytes staged. Raises
        WeightMismatchError (nothing staged) on a missing, unknown or misshapen tensor."""
        self.staged = None
        state = resolve_update(update)
        check_state(shapes_of(state), self.config)
        self.staged = shard_state(state, self.config, self.rank, self.world_size)
        return sum(t.numel() * t.element_size() for t in self.staged.values())

    def stage_shards(self, shards: Any, owned: bool = False) -> int:
        """Stage this rank's pre-cut shards (a `put_shards` object, resolved by Ray); checked against the
        model's tensors (or their shapes while asleep) like `stage`. `owned`: the shards are the engine's
        to keep (a colocated hand-over made them for it): cast to the weights' dtypes where they differ,
        and kept as they are when committed while asleep (no copy; `wake_up` adopts them)."""
        self.staged = None
        if _is_ref(shards):
            shards = sys.modules["ray"].get(shards)
        model = self.runner.model if self.shapes is None else self.shapes
        check_shards(shards, model)
        if owned:
            dtypes = {k: t.dtype for k, t in engine_tensors(model).items()}
            shards = {k: t.to(dtype=dtypes[k]) for k, t in shards.items()}
        self.staged, self.staged_owned = dict(shards), owned
        return sum(t.numel() * t.element_size() for t in self.staged.values())

    def stage_pieces(self, refs: Any, channel: Any = None) -> int:
        """Stage this rank's shards assembled from the pieces a trainer's ranks sent it (a
        `TrainerUpdate`'s refs for this rank; received over its tpu_dist `channel` when it has one);
        checked like `stage_shards`. A colocated hand-over's marker (`tpuray.rl.sync.handover.Handed`) stages
        the shards the trainer rank in this process left for it, owned."""
        self.staged = None
        if handover.is_handed(refs):
            return self.stage_shards(handover.take(list(refs)), owned=True)
        pieces = resolve_pieces(refs, channel, self.rank)
        # row blocks over the received buffers: committed or discarded before the next update reuses them
        shards = assemble(pieces, self.config, self.rank, self.world_size, deferred=True)
        return self.stage_shards(shards)

    def commit(self) -> int:
        """Copy the staged shards into the model; returns bytes written. Asleep, the update waits for
        wake_up: owned shards as they are, others copied into what it restores (the host copy, or owned
        shards taken before), or at level 2 into a host copy of their own (they may be views of reused buffers)."""
        if self.staged is None:
            raise RuntimeError("commit_weights without a staged update (call stage_weights first)")
        staged, self.staged = self.staged, None
        written = sum(t.numel() * t.element_size() for t in staged.values())
        if self.asleep and self.staged_owned:
            self.restore = staged
        elif self.asleep and self.restore is None:
            self.restore = {k: rows.owned(t) for k, t in staged.items()}
        elif self.restore is not None:  # asleep
            written = copy_shards(_Holder(self.restore), staged)
        else:
            written = copy_shards(self.runner.model, staged)
        self.version += 1
        return written

    def discard(self) -> None:
        self.staged = None

    # -- sleep / wake-up ----------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free the device memory of the weights and the KV cache (its contents are not needed between
        rollouts). Level 1: the weights go to a host copy first; level 2: they are discarded (no copy to
        the host: for an engine whose next update replaces them all before `wake_up`). Each tensor keeps
        its Python object (the model and cache still hold it) and gets an empty storage. Returns bytes
        freed (0 when already asleep)."""
        check_sleep_level(level)
        if self.sleep_level:
            return 0
        weights = engine_tensors(self.runner.model)
        self.shapes = _Holder({k: torch.empty_like(t, device="meta") for k, t in weights.items()})
        if level == 1:
            self.restore = {k: t.detach().to("cpu", copy=True) for k, t in weights.items()}
        freed, seen = 0, set()
        for t in [*weights.values(), *self.runner.cache.k, *self.runner.cache.v]:
            if id(t) in seen:  # tied embeddings: one tensor under two names
                continue
            seen.add(id(t))
            freed += t.numel() * t.element_size()
            self.freed.append((t, tuple(t.shape)))
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.sleep_level = level
        return freed

    def wake_up(self) -> int:
        """Retake the device memory and restore the weights (level 1: with any update made while asleep;
        level 2: the update made while asleep, which must exist: RuntimeError, still asleep, otherwise);
        the KV cache comes back zeroed. A restored tensor already on the weights' device, of their dtype
        and shape, becomes the weight itself (handed-over shards: no copy); others are copied in. Returns
        bytes retaken (0 when awake)."""
        if not self.sleep_level:
            return 0
        if self.restore is None:
            raise RuntimeError(
                "wake_up after sleep(level=2) needs a weight update first: the weights were discarded "
                "(update_weights with the full state, then wake_up; or sleep(level=1) to keep them)"
            )
        freed, self.freed = self.freed, []
        shapes = {id(t): shape for t, shape in freed}
        with torch.no_grad():
            weights = engine_tensors(self.runner.model)
            for key, t in weights.items():
                t.data = _restored(self.restore[key], shapes[id(t)], t)
            for t in {id(t): t for t in [*self.runner.cache.k, *self.runner.cache.v]}.values():
                t.data = torch.zeros(shapes[id(t)], dtype=t.dtype, device=t.device)
        self.restore, self.shapes, self.sleep_level = None, None, 0
        return sum(math.prod(shape) * t.element_size() for t, shape in freed)

    @property
    def asleep(self) -> bool:
        return self.sleep_level != 0


def _restored(src: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The storage a waking weight gets: `src` itself where it can serve as the weight (every tensor
    `wake_up` restores from is the engine's own: a copy it made, or shards handed over to it), else a
    new tensor on the weight's device holding `src`'s values."""
    if (
        src.device == like.device
        and src.dtype == like.dtype
        and tuple(src.shape) == shape
        and src.is_contiguous()
    ):
        return src.detach()
    return torch.empty(shape, dtype=like.dtype, device=like.device).copy_(src)


class _Holder:
    """A host copy shaped like a ShardedLlama for `copy_shards` (embed / norm / lm_head / layers)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.embed, self.norm, self.lm_head = tensors["embed"], tensors["norm"], tensors["lm_head"]
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            if key.startswith("layers."):
                _, i, name = key.split(".", 2)
                layers.setdefault(int(i), {})[name] = t
        self.layers = [layers[i] for i in sorted(layers)]


class RolloutWorker(EngineWorker):
    """An `EngineWorker` (one tensor-parallel rank of the embedded engine) that takes weight updates and
    can sleep. Started by `EmbeddedRolloutEngine` in a `SliceWorkerGroup`."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: RunnerWeights | None = None

    def load(self, path: str, engine_kwargs: dict) -> dict:
        import os

        info = super().load(path, engine_kwargs)
        assert self.runner is not None  # loaded by super().load
        rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.weights = RunnerWeights(self.runner, path, rank, world_size)
        return info

    def _w(self) -> RunnerWeights:
        if self.weights is None:
            raise RuntimeError("RolloutWorker used before load()")
        return self.weights

    def stage_weights(self, update: Any) -> int:
        return self._w().stage(update)

    def stage_shards(self, shards: Any) -> int:
        return self._w().stage_shards(shards)

    def stage_pieces(self, refs: Any, channel: Any = None) -> int:
        return self._w().stage_pieces(refs, channel)

    def commit_weights(self) -> int:
        return self._w().commit()

    def discard_weights(self) -> None:
        self._w().discard()

    def sleep(self, level: int = 1) -> int:
        return self._w().sleep(level)

    def wake_up(self) -> int:
        return self._w().wake_up()
