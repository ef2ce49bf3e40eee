"""The checks of a weight update, before anything is written: `check_names` is the one check of names
and shapes (the first unknown, misshapen or missing tensor, named with the shape expected), which a
full state dict (`check_state`), a rank's pre-cut shards (`check_shards`), the pieces a rollout rank
joins (`tpuray.rl.weights.join.join_pieces`) and the commit (`copy_shards`) all go through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tpuray.rl.weights.layout import allowed_shapes, engine_tensors, expected_shapes
from tpuray.rl.weights.rows import Rows

Shapes = Mapping[str, tuple[int, ...]]


class WeightMismatchError(ValueError):
    """A weight update whose names or shapes differ from the engine's model; nothing was overwritten."""


def check_names(
    got: Mapping[str, tuple[int, ...] | None],
    allowed: Shapes,
    required: Shapes | None = None,
    *,
    what: str = "weight update",
    kind: str = "tensor",
    hint: str = "",
) -> None:
    """Raise WeightMismatchError naming the first mismatch of `got` (name -> shape; None: a shape checked
    elsewhere) against `allowed` (every name an update may carry, with its shape): an unknown name, a
    shape that differs, then the first name of `required` (all of `allowed` by default) that is missing,
    with its shape. `what` and `kind` word the message ("weight update", "tensor"); `hint` ends the one
    about a missing name."""
    for name, shape in got.items():
        if name not in allowed:
            known = ", ".join(list(allowed)[:4])
            of = "" if shape is None else f" (shape {tuple(shape)})"
            raise WeightMismatchError(
                f"{what}: unknown {kind} {name!r}{of}; the engine's model has {len(allowed)} {kind}s named "
                f"like {known}, ..."
            )
        if shape is not None and tuple(shape) != tuple(allowed[name]):
            raise WeightMismatchError(
                f"{what}: {kind} {name!r} has shape {tuple(shape)}; expected {tuple(allowed[name])}"
            )
    required = allowed if required is None else required
    missing = [n for n in required if n not in got]
    if missing:
        raise WeightMismatchError(
            f"{what}: {kind} {missing[0]!r} (shape {tuple(required[missing[0]])}) is missing "
            f"({len(missing)} of {len(required)} missing){hint}"
        )


def check_state(shapes: Shapes, config: Mapping[str, Any]) -> None:
    """`check_names` of `shapes` (name -> shape of a full HF state dict) against the model of `config`."""
    check_names(shapes, allowed_shapes(config), expected_shapes(config), hint="; send the full state dict")


def shapes_of(state: Mapping[str, Any], dtensors: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of a state dict; a value that is not a full floating-point tensor is a
    WeightMismatchError (`dtensors`: a DTensor counts, by its global shape)."""
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise WeightMismatchError(f"weight update: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if type(t).__name__ == "DTensor" and not dtensors:
            raise WeightMismatchError(
                f"weight update: {name!r} is a DTensor (an FSDP2 / tensor-parallel trainer's shard); send "
                "full tensors (DTensor.full_tensor()), or send each rank's shard with tpuray.rl.SyncTarget.send "
                "(docs/rl.md)"
            )
        if not t.is_floating_point():
            raise WeightMismatchError(
                f"weight update: {name!r} has dtype {t.dtype}; valid: a floating-point dtype"
            )
        out[name] = tuple(t.shape)
    return out


def engine_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of a model's tensors that an update overwrites (`engine_tensors`), by name."""
    return {key: tuple(t.shape) for key, t in engine_tensors(model).items()}


def check_shards(shards: Any, model: Any) -> None:
    """A rank's pre-cut shards (keyed like `engine_tensors`) against its model's tensors: each a
    floating-point tensor, then `check_names` (WeightMismatchError naming the first mismatch)."""
    what = "sharded weight update"
    if not isinstance(shards, Mapping):
        raise WeightMismatchError(f"a sharded update must hold a dict per rank, got {type(shards).__name__}")
    for key, t in shards.items():
        if not isinstance(t, torch.Tensor | Rows) or not t.is_floating_point():
            raise WeightMismatchError(f"{what}: shard {key!r} is not a floating-point tensor")
    check_names({k: tuple(t.shape) for k, t in shards.items()}, engine_shapes(model), what=what, kind="shard")
