"""A trainer rank's weight-sync pieces cut from tensors on the real chip (`tpuray.rl.weights.cut`, no Ray): each
piece is copied once to the host, compact (weight_sync "object_store") or into its packed buffer
("tpu_dist"), and equals the same cut of the same weights on the CPU; the column pieces (o_proj,
down_proj) are strided views of the device tensor, made contiguous there before the copy. Plain tensors
(rank 0 of a replicated trainer) and FSDP2's DTensors (`Shard(0)` on a one-device mesh)."""

from __future__ import annotations

import functools

import pytest
import torch

CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
    "num_hidden_layers": 1,
}


def _cpu_state() -> dict[str, torch.Tensor]:
    from tpuray.rl.weights.layout import expected_shapes

    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in expected_shapes(CONFIG).items()}


def _check_cut(state: dict, want_state: dict, part) -> None:
    from tpuray.rl.sync.collective import pack, unpack
    from tpuray.rl.weights.cut import trainer_pieces

    for world in (1, 2, 4):
        want = trainer_pieces(want_state, 0, world, part)
        compact = trainer_pieces(state, 0, world, part)
        packed = [pack(p) for p in trainer_pieces(state, 0, world, part, compact=False)]
        for r in range(world):
            got = unpack(*packed[r])
            assert compact[r].keys() == got.keys() == want[r].keys()
            for name, (start, t) in want[r].items():
                for kind, (s, piece) in (("compact", compact[r][name]), ("packed", got[name])):
                    assert piece.device.type == "cpu" and s == start, (kind, world, r, name)
                    assert torch.equal(piece, t), (kind, world, r, name)


@pytest.mark.parametrize("layout", ["embedded", "vllm"])
def test_pieces_cut_on_the_chip_equal_the_cpu_cut(tpu, layout):
    from tpuray.rl.weights.layout import embedded_part
    from tpuray.rl.weights.vllm_layout import vllm_part

    part = embedded_part if layout == "embedded" else functools.partial(vllm_part, config=CONFIG)
    cpu = _cpu_state()
    _check_cut({n: t.to(tpu) for n, t in cpu.items()}, cpu, part)


def test_fsdp2_shards_on_the_chip_cut_like_the_cpu(tpu, process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tpuray.rl.weights.layout import embedded_part

    mesh = init_device_mesh("tpu", (1,))
    cpu = _cpu_state()
    dtensors = {n: distribute_tensor(t.to(tpu), mesh, [Shard(0)]) for n, t in cpu.items()}
    _check_cut(dtensors, cpu, embedded_part)


def test_fsdp2_hand_over_on_the_chip_equals_the_cpu_cut(tpu, process_group):
    """A colocated trainer rank's in-process hand-over (`tpuray.rl.sync.handover`, weight_sync="tpu_dist")
    from FSDP2's DTensors on the chip (`full_tensor()` over the one-device mesh): the embedded engine's
    fused shards and vLLM's unfused part stay on the chip and equal the CPU's cut of the same weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tpuray.rl.sync import handover
    from tpuray.rl.weights.cut import shard_state
    from tpuray.rl.weights.vllm_layout import vllm_part

    mesh = init_device_mesh("tpu", (1,))
    cpu = _cpu_state()
    dtensors = {n: distribute_tensor(t.to(tpu), mesh, [Shard(0)]) for n, t in cpu.items()}
    shards = handover.rank_shards(dtensors, 0, 1, CONFIG)
    want = shard_state(cpu, CONFIG, 0, 1)
    assert shards.keys() == want.keys()
    for key, t in shards.items():
        assert t.device.type == "tpu" and torch.equal(t.cpu(), want[key]), key
    pieces = handover.rank_pieces(dtensors, 0, 1, CONFIG, functools.partial(vllm_part, config=CONFIG))
    assert pieces.keys() == cpu.keys()
    for name, (start, t) in pieces.items():
        assert start == 0 and t.device.type == "tpu" and torch.equal(t.cpu(), cpu[name]), name


def test_row_blocks_commit_into_weights_on_the_chip(tpu):
    """A rollout rank's received pieces (on the host, as a transfer leaves them; each part split between
    two senders) staged as row blocks (`assemble(deferred=True)`) and committed into tensors on the
    chip, block by block into row views of each: the chip's tensors equal the CPU's shard_state."""
    from tpuray.rl.rollout.embedded_worker import _Holder
    from tpuray.rl.weights.cut import shard_state, trainer_pieces
    from tpuray.rl.weights.join import assemble, copy_shards
    from tpuray.rl.weights.rows import Rows

    state = _cpu_state()
    whole = trainer_pieces(state, 0, 2)[1]
    senders: list[dict] = [{}, {}]
    for name, (start, t) in whole.items():
        half = t.shape[0] // 2
        senders[0][name] = (start, t[:half])
        if half < t.shape[0]:
            senders[1][name] = (start + half, t[half:])
    staged = assemble(senders, CONFIG, 1, 2, deferred=True)
    assert isinstance(staged["layers.0.qkv"], Rows)
    want = shard_state(state, CONFIG, 1, 2)
    on_chip = {k: torch.zeros_like(t).to(tpu) for k, t in want.items()}
    copy_shards(_Holder(on_chip), staged)
    for key, t in want.items():
        assert on_chip[key].device.type == tpu.type and torch.equal(on_chip[key].cpu(), t), key
