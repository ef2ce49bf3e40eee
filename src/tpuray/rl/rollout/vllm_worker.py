"""`WeightsExtension`: tpuray's vLLM worker extension (vLLM's `worker_extension_cls`), mixed by vLLM into
each of its workers (one per tensor-parallel rank), reached from the rollout engine with
`collective_rpc`.

An update is two-phase, like the embedded engine's (`embedded_worker`): `tpuray_stage_weights` checks every
name and shape against the model's config.json with `tpuray.rl.weights.check.check_state` (the one check,
shared with the embedded engine) and keeps the update; only when every rank staged does
`tpuray_commit_weights` load it with vLLM's in-place reload (the model's own `load_weights`, whose
weight loaders fuse q/k/v and gate/up and keep this rank's tensor-parallel part; a worker that holds the
whole model gets each tensor already on its device, sent a window ahead: `tpuray.rl.weights.prefetch`).
`tpuray_discard_weights` drops a staged update.
A refusal is returned by the stage call, not raised (an error raised by one worker of vLLM's Ray executor
can come back again from the next `collective_rpc`).

A full state dict travels through vLLM's engine-core RPC (msgpack), which carries bytes but not tensors
inside `collective_rpc` arguments: `pack_state` / `unpack_state` send each tensor as (dtype, shape, raw
bytes), and every worker receives all of it. A `TrainerUpdate` (an RLRun's trainer ranks) does not pass the
RPC: `tpuray_stage_pieces` takes this rank's ObjectRefs (or tpu_dist offers) from a named holder actor and
pulls them (or receives them over the update's tpu_dist group, which this worker joins at its first update):
only its own pieces, cut in vLLM's layout (rl/weights/vllm_layout.py), joined straight into the sparse
full-shape tensors that commit loads (`SparseParts`: buffers kept from one update to the next).
No top-level vllm import here: vLLM imports this module by its qualified name in every worker.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tpuray.rl.sync.collective import TransferError
from tpuray.rl.sync.update import resolve_pieces
from tpuray.rl.weights.buffers import BufferPool
from tpuray.rl.weights.check import WeightMismatchError, check_state, shapes_of
from tpuray.rl.weights.join import join_pieces
from tpuray.rl.weights.prefetch import prefetched
from tpuray.rl.weights.vllm_layout import SparseParts, vllm_part

EXTENSION = "tpuray.rl.rollout.vllm_worker.WeightsExtension"
TPU_WEIGHT_FLIPPED = "_tpu_weight_flipped"  # vllm_torchtpu.layers.adapter.linear_common.WEIGHT_FLIPPED_ATTR
LOST = "lost"  # tpuray_stage_pieces's [LOST, why]: the update's pieces were lost with their sender
Packed = dict[str, tuple[str, list[int], bytes]]


def pack_state(state: Mapping[str, torch.Tensor]) -> Packed:
    """name -> (dtype name, shape, raw bytes) of a checked state dict."""
    out: Packed = {}
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = (str(t.dtype).removeprefix("torch."), list(t.shape), raw)
    return out


def unpack_state(packed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict `pack_state` packed (msgpack may hand the tuples back as lists)."""
    out = {}
    for name, (dtype, shape, raw) in packed.items():
        out[name] = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
    return out


class WeightsExtension:
    """Weight updates on a vLLM worker (`self.model_runner.model`, `self.model_config` are the worker's)."""

    model_runner: Any
    model_config: Any
    reload_weights: Any  # vLLM Worker.reload_weights
    _tpuray_staged: dict[str, torch.Tensor] | None = None  # a mixin: vLLM never calls our __init__
    _tpuray_parts: SparseParts | None = None  # this rank's parts of a TrainerUpdate
    _tpuray_pool: BufferPool | None = None  # the buffers of those parts, reused from update to update
    _tpuray_emptied: list[tuple[Any, int]] = []  # (KV cache storage, its bytes) while emptied; reassigned

    def _tpuray_buffers(self) -> BufferPool:
        """This worker's buffers for the sparse parts of an update, made at its first (kept after)."""
        if self._tpuray_pool is None:
            self._tpuray_pool = BufferPool()
        return self._tpuray_pool

    def _tpuray_config(self) -> dict[str, Any]:
        return json.loads((Path(self.model_config.model) / "config.json").read_text())

    def tpuray_stage_pieces(self, holder: str, namespace: str) -> int | str | list[str]:
        """A TrainerUpdate's pieces for this rank (vLLM's tensor-parallel rank), taken from the named
        holder actor (tpuray.rl.rollout.vllm) and joined into this rank's part of each HF tensor; returns
        the bytes staged, or (as tpuray_stage_weights) the message naming the first missing, unknown or
        misshapen tensor, or [LOST, why] where the pieces could not be had (their sender died); nothing
        is staged then."""
        import ray
        from vllm.distributed import get_tensor_model_parallel_rank

        if not ray.is_initialized():
            raise RuntimeError(
                "tpuray_stage_pieces runs in vLLM workers of its Ray executor (a rollout engine on a TPU "
                "slice); this worker is not connected to Ray"
            )
        rank = get_tensor_model_parallel_rank()
        refs, channel = ray.get(ray.get_actor(holder, namespace=namespace).get.remote(rank))
        return self.tpuray_stage_refs(refs, channel)

    def tpuray_stage_refs(self, refs: list[Any], channel: Any) -> int | str | list[str]:
        """`tpuray_stage_pieces` with this rank's ObjectRefs (or tpu_dist offers and their channel) given:
        called in process where vLLM runs in the caller's process (colocated:
        tpuray.rl.rollout.vllm_colocated)."""
        import ray
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self._tpuray_parts = None
        rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        try:  # from the object store, or over the tpu_dist group
            pieces = resolve_pieces(refs, channel, rank)
        except (ray.exceptions.ObjectLostError, TransferError) as e:
            return [LOST, f"{type(e).__name__}: {e}"]  # the sender died: nothing staged, update lost
        config = self._tpuray_config()
        part = functools.partial(vllm_part, config=config)
        # joined straight into the sparse full tensors vLLM's loaders take, kept from update to update
        sparse = SparseParts(config, rank, world, buffers=self._tpuray_buffers())
        try:
            parts = join_pieces(pieces, config, rank, world, part, into=sparse.block)
        except WeightMismatchError as e:
            return str(e)
        self._tpuray_parts = sparse
        return sum(t.numel() * t.element_size() for t in parts.values())

    def tpuray_stage_weights(self, packed: Mapping[str, Any]) -> int | str:
        """Check the update and keep it; returns the bytes staged, or the WeightMismatchError's message
        (the first missing, unknown or misshapen tensor; nothing is staged). Returned, not raised: an
        error raised by one worker of vLLM's Ray executor can surface again in the next collective_rpc."""
        self._tpuray_staged = None
        state = unpack_state(packed)
        try:
            check_state(shapes_of(state), self._tpuray_config())
        except WeightMismatchError as e:
            return str(e)
        self._tpuray_staged = state
        return sum(t.numel() * t.element_size() for t in state.values())

    def tpuray_stage_tensors(self, state: Mapping[str, torch.Tensor]) -> int | str:
        """`tpuray_stage_weights` for a state dict of tensors, unpacked: where vLLM's engine core runs in
        the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), collective_rpc hands them over as they
        are, so nothing is copied before the load."""
        self._tpuray_staged = None
        try:
            check_state(shapes_of(state), self._tpuray_config())
        except WeightMismatchError as e:
            return str(e)
        self._tpuray_staged = dict(state)
        return sum(t.numel() * t.element_size() for t in state.values())

    def tpuray_commit_weights(self) -> int:
        """Load the staged update with vLLM's in-place reload (`reload_weights`: the model's
        `load_weights` between vLLM's layer-wise reload hooks, which redo the backend's weight processing,
        e.g. the CPU backend's repacked GEMM weights); returns the bytes of this rank's parameters."""
        staged, self._tpuray_staged = self._tpuray_staged, None
        parts, self._tpuray_parts = self._tpuray_parts, None
        if parts is not None:  # full-shape tensors holding only this rank's blocks: the loaders read those
            self._tpuray_reload(self._tpuray_ahead(parts.tensors()))
        elif staged is not None:
            self._tpuray_reload(self._tpuray_ahead(iter(staged.items())))
        else:
            raise RuntimeError("tpuray_commit_weights without a staged update (tpuray_stage_weights first)")
        return sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())

    def _tpuray_ahead(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged host tensors, each sent to the model's device a window ahead of the reload that
        loads it (tpuray.rl.weights.prefetch), where this worker holds the whole model (tensor-parallel
        size 1); with more ranks each rank's loaders keep only its part of a tensor, so the host tensors go
        to the loaders as they are (sending whole tensors would move tensor-parallel-size times the bytes)."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() > 1:
            return weights
        device = next(self.model_runner.model.parameters()).device  # before the reload moves them to meta
        return prefetched(weights, device)

    def _tpuray_reload(self, weights: Any) -> None:
        """vLLM's in-place reload (its GPU/CPU worker's `reload_weights`); vLLM-TorchTPU's worker has none,
        so there the same steps run here: vLLM's layer-wise reload (each layer's weights re-created in the
        checkpoint's layout, loaded, processed for the kernels again, copied into the weights the compiled
        programs hold). vLLM-TorchTPU marks a linear layer whose weight it transposed after loading, and
        skips a marked layer; the mark is cleared so that the reloaded weight is transposed too."""
        if hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=weights)
            return
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        initialize_layerwise_reload(model)
        for module in model.modules():
            if getattr(module, TPU_WEIGHT_FLIPPED, False):
                setattr(module, TPU_WEIGHT_FLIPPED, False)
        model.load_weights(weights)
        finalize_layerwise_reload(model, self.model_config)

    def tpuray_discard_weights(self) -> None:
        self._tpuray_staged = self._tpuray_parts = None

    def tpuray_empty_kv_cache(self) -> int:
        """Free this rank's KV cache memory (vLLM's CPU backend, which has no sleep mode): each cache
        tensor keeps its object and shape, its storage is emptied. Returns the bytes freed (0 if empty)."""
        if self._tpuray_emptied:
            return 0
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.model_runner.kv_caches}
        self._tpuray_emptied = [(s, s.nbytes()) for s in storages.values()]
        for s, _ in self._tpuray_emptied:
            s.resize_(0)
        return sum(n for _, n in self._tpuray_emptied)

    def tpuray_refill_kv_cache(self) -> int:
        """Retake the memory `tpuray_empty_kv_cache` freed (contents undefined: reset the prefix cache)."""
        emptied, self._tpuray_emptied = self._tpuray_emptied, []
        for s, nbytes in emptied:
            s.resize_(nbytes)
        return sum(n for _, n in emptied)
