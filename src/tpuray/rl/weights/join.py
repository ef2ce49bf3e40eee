"""A rollout rank's side of a weight update: `join_pieces` joins the pieces every trainer rank sent it
(`tpuray.rl.weights.cut.trainer_pieces`) into its part of each HF tensor, in the layout of a `part`
function (`embedded_part` by default, `tpuray.rl.weights.vllm_layout.vllm_part` for vLLM); `assemble` is
the embedded engine's (fused as it holds them); `copy_shards` writes a rank's checked shards into its
model's tensors in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tpuray.rl.weights import rows
from tpuray.rl.weights.check import WeightMismatchError, check_names, engine_shapes
from tpuray.rl.weights.layout import (
    PartFn,
    Piece,
    allowed_shapes,
    embedded_part,
    engine_tensors,
    expected_shapes,
    fuse,
    part_shape,
)
from tpuray.rl.weights.rows import Rows

Into = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]  # HF name, part shape, dtype -> where


def copy_shards(model: Any, shards: Mapping[str, torch.Tensor | Rows]) -> int:
    """Overwrite the model's tensors in place (their storage, so compiled programs keep reading them) with
    `shards`; every name and shape is checked first (`check_names`), so a mismatch raises before any
    write. Returns the bytes written."""
    check_names({k: tuple(t.shape) for k, t in shards.items()}, engine_shapes(model), kind="shard")
    dest = engine_tensors(model)
    written = 0
    with torch.no_grad():
        for key, t in shards.items():
            rows.write(dest[key], t)
            written += t.numel() * dest[key].element_size()
    return written


def join_pieces(
    received: list[dict[str, Piece]],
    config: Mapping[str, Any],
    rank: int,
    world_size: int,
    part: PartFn = embedded_part,
    deferred: bool = False,
    into: Into | None = None,
) -> dict[str, Any]:
    """Rollout rank `rank`'s part of each HF tensor (keyed by HF name) from the pieces every trainer rank
    sent it, in the layout of `part`; WeightMismatchError names the first missing, unknown, misshapen or
    incomplete tensor. A tensor whose part is empty (none of its rows on this rank) may be left out.
    `deferred`: parts joined from several pieces are their row blocks (as `fuse`). `into`: every part is
    copied into the tensor `into(name, part shape, dtype)` gives (e.g. its place in a bigger buffer)."""
    allowed = allowed_shapes(config)
    by_name: dict[str, list[Piece]] = {}
    for pieces in received:
        for name, piece in pieces.items():
            by_name.setdefault(name, []).append(piece)
    shapes = {n: part_shape(s, part(n, s, rank, world_size)) for n, s in allowed.items()}
    required = {n: s for n, s in expected_shapes(config).items() if 0 not in shapes[n]}
    check_names(dict.fromkeys(by_name), allowed, required, what="weight sync")  # pieces: checked by _join
    return {n: _join(n, ps, shapes[n], allowed[n], deferred, into) for n, ps in by_name.items()}


def assemble(
    received: list[dict[str, Piece]],
    config: Mapping[str, Any],
    rank: int,
    world_size: int,
    deferred: bool = False,
) -> dict[str, Any]:
    """Rollout rank `rank`'s fused shards (the embedded engine's) from the pieces every trainer rank
    sent it; WeightMismatchError names the first missing, unknown, misshapen or incomplete tensor
    (nothing is written). `deferred`: joined and fused as row blocks (as `fuse`), which stay views of
    the received pieces: commit or discard them before those are overwritten."""
    return fuse(join_pieces(received, config, rank, world_size, deferred=deferred), config, deferred)


def _join(
    name: str,
    pieces: list[Piece],
    shape: tuple[int, ...],
    full: tuple[int, ...],
    deferred: bool = False,
    into: Into | None = None,
) -> Any:
    pieces = sorted(pieces, key=lambda p: p[0])
    row = 0
    for start, t in pieces:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise WeightMismatchError(f"weight sync: a piece of {name!r} is not a floating-point tensor")
        if start != row or tuple(t.shape[1:]) != shape[1:]:
            raise WeightMismatchError(
                f"weight sync: {name!r} has a piece of shape {tuple(t.shape)} at row {start}; expected "
                f"rows from {row} of a part of shape {shape} (full shape {full})"
            )
        row += t.shape[0]
    if row != shape[0]:
        raise WeightMismatchError(f"weight sync: {name!r} has {row} of its part's {shape[0]} rows")
    if into is not None:
        dest = into(name, shape, pieces[0][1].dtype)
        for start, t in pieces:
            dest[start : start + t.shape[0]].copy_(t)
        return dest
    if len(pieces) == 1:
        return pieces[0][1]
    return Rows(pieces) if deferred else torch.cat([t for _, t in pieces])
