"""Staged shards as row blocks (tpuray.rl.weights.rows): a rollout rank's join and fuse describe its shards
over the received pieces without copying them, and the commit writes each block into its rows once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _rl_util import state_dict

from tpuray.rl.rollout.embedded_worker import _Holder
from tpuray.rl.weights.check import WeightMismatchError, check_shards
from tpuray.rl.weights.cut import shard_state, trainer_pieces
from tpuray.rl.weights.join import assemble, copy_shards
from tpuray.rl.weights.rows import Rows, owned, write


def test_rows_stack_like_cat_and_write_each_block_once():
    a, b, c = torch.randn(2, 3), torch.randn(4, 3), torch.randn(1, 3)
    inner = Rows([(0, a), (2, b)])
    rows = Rows.stack([inner, c])
    assert rows.shape == (7, 3) and rows.numel() == 21 and rows.element_size() == 4
    assert [start for start, _ in rows.blocks] == [0, 2, 6] and rows.is_floating_point()
    want = torch.cat([a, b, c])
    assert torch.equal(rows.materialize(), want) and torch.equal(owned(rows), want)
    dest = torch.zeros(7, 3, dtype=torch.float64)
    write(dest, rows)  # cast to the destination's dtype, in place
    assert dest.dtype == torch.float64 and torch.equal(dest, want.double())
    assert not Rows([(0, torch.ones(2, 2, dtype=torch.int64))]).is_floating_point()
    with pytest.raises(ValueError, match="at least one block"):
        Rows([])


def test_deferred_assemble_copies_nothing_until_the_commit(tiny_models):
    """Each piece of rank 1's part split between two senders (an FSDP2 trainer's Shard(0) rows): the
    deferred shards are row blocks over the received pieces (no byte copied), they pass the receiving
    rank's check, and the commit writes exactly shard_state's tensors; a misshapen piece is refused."""
    config = json.loads((Path(tiny_models[0]) / "config.json").read_text())
    state = state_dict(tiny_models[0])
    whole = trainer_pieces(state, rank=0, tensor_parallel_size=2)[1]
    senders: list[dict] = [{}, {}]
    for name, (start, t) in whole.items():
        half = t.shape[0] // 2
        senders[0][name] = (start, t[:half])
        if half < t.shape[0]:
            senders[1][name] = (start + half, t[half:])
    received = {t.data_ptr() for p in senders for _, t in p.values()}
    got = assemble(senders, config, 1, 2, deferred=True)
    want = shard_state(state, config, 1, 2)
    assert got.keys() == want.keys() and isinstance(got["layers.0.qkv"], Rows)
    assert all(b.data_ptr() in received for t in got.values() for _, b in getattr(t, "blocks", [])), (
        "a deferred shard's blocks are the received pieces themselves"
    )
    holder = _Holder({k: torch.zeros_like(t) for k, t in want.items()})
    check_shards(got, holder)
    assert copy_shards(holder, got) == sum(t.numel() * t.element_size() for t in want.values())
    assert all(
        torch.equal(getattr(holder, k) if k in ("embed", "norm", "lm_head") else _layer(holder, k), t)
        for k, t in want.items()
    )
    name = "model.layers.0.mlp.up_proj.weight"
    start, t = senders[1][name]
    with pytest.raises(WeightMismatchError, match="up_proj.weight' has a piece of shape"):
        assemble([senders[0], {**senders[1], name: (start, t[:, :-1])}], config, 1, 2, deferred=True)


def _layer(holder: _Holder, key: str) -> torch.Tensor:
    _, i, name = key.split(".", 2)
    return holder.layers[int(i)][name]
