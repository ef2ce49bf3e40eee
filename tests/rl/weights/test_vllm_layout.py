"""tpuray.rl.weights.vllm_layout: each vLLM tensor-parallel rank's part of every HF tensor (q/k/v with kv
heads shared when there are fewer than ranks, gate/up, o/down columns, the padded vocab split), the parts of
all ranks covering each tensor as vLLM holds it; and, against vLLM's own layers, that loading a rank's "sparse
full" tensors (NaN outside its part) gives bit-identical parameters to loading the full tensors.

The vLLM check builds vLLM's parallel layers in this process, with no engine and no process group: it
patches vLLM's `get_tensor_model_parallel_world_size` / `_rank` in the modules that read them (the layers
and their parameters), which is all that decides a layer's geometry and what its loaders narrow."""

from __future__ import annotations

import functools

import pytest
import torch

from tpuray.rl.weights.buffers import BufferPool
from tpuray.rl.weights.cut import row_pieces, trainer_pieces
from tpuray.rl.weights.join import join_pieces
from tpuray.rl.weights.layout import expected_shapes, part_range
from tpuray.rl.weights.vllm_layout import SparseParts, vllm_part, vocab_rows

HEADS, HEAD_DIM, HIDDEN, INTER = 8, 4, 32, 24


def llama(kv_heads: int, vocab: int = 100, **extra) -> dict:
    return {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "vocab_size": vocab,
        "num_hidden_layers": 1,
        "model_type": "qwen2",  # q/k/v biases
        **extra,
    }


def parts_of(name: str, shape: tuple[int, ...], world: int, config: dict) -> list:
    return [vllm_part(name, shape, r, world, config) for r in range(world)]


def blocks(start: int, size: int, world: int) -> list[tuple[int, int]]:
    return [(start + r * size, start + (r + 1) * size) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_parts_cover_each_tensor_as_vllm_holds_it(kv_heads, world):
    config = llama(kv_heads)
    shapes = expected_shapes(config)
    layer = "model.layers.0."
    for name, shape in shapes.items():
        parts = parts_of(name, shape, world, config)
        if name.endswith(("norm.weight",)):
            assert parts == [None] * world, name
            continue
        dims = {p[0] for p in parts}
        assert len(dims) == 1, name
        dim = dims.pop()
        ranges = [(lo, hi) for _, lo, hi in parts]
        if name.startswith(layer + "self_attn.q_proj"):
            assert dim == 0 and ranges == blocks(0, HEADS // world * HEAD_DIM, world), name
        elif name.startswith((layer + "self_attn.k_proj", layer + "self_attn.v_proj")):
            assert dim == 0
            if kv_heads >= world:  # an even split of the kv heads
                assert ranges == blocks(0, kv_heads // world * HEAD_DIM, world), name
            else:  # one whole head each, head h shared by world / kv_heads consecutive ranks
                share = world // kv_heads
                assert ranges == [
                    ((r // share) * HEAD_DIM, (r // share + 1) * HEAD_DIM) for r in range(world)
                ]
                assert sorted(set(ranges)) == blocks(0, HEAD_DIM, kv_heads)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            assert dim == 0 and ranges == blocks(0, INTER // world, world), name
        elif name.endswith("o_proj.weight"):
            assert dim == 1 and ranges == blocks(0, HEADS * HEAD_DIM // world, world), name
        elif name.endswith("down_proj.weight"):
            assert dim == 1 and ranges == blocks(0, INTER // world, world), name
        else:
            assert name in ("model.embed_tokens.weight", "lm_head.weight"), name
            assert dim == 0 and ranges == [vocab_rows(100, r, world) for r in range(world)]
        covered = sorted(set(ranges))  # every row / column of the tensor, in rank order, no overlap
        assert covered[0][0] == 0 and covered[-1][1] == shape[dim], name
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False)), name
    assert vllm_part("model.layers.0.self_attn.o_proj.bias", (HIDDEN,), 0, world, config) is None
    tied = llama(kv_heads, tie_word_embeddings=True)
    assert parts_of("lm_head.weight", (100, HIDDEN), world, tied) == [(0, 0, 0)] * world


@pytest.mark.parametrize(
    ("vocab", "world", "rows"),
    [
        (512, 1, [(0, 512)]),
        (512, 2, [(0, 256), (256, 512)]),
        (512, 4, blocks(0, 128, 4)),
        (520, 1, [(0, 520)]),
        (520, 2, [(0, 288), (288, 520)]),  # padded to 576
        (520, 4, [(0, 144), (144, 288), (288, 432), (432, 520)]),
        (100, 1, [(0, 100)]),
        (100, 2, [(0, 64), (64, 100)]),  # padded to 128
        (100, 4, [(0, 32), (32, 64), (64, 96), (96, 100)]),
    ],
)
def test_vocab_rows_follow_the_padded_split(vocab, world, rows):
    config = llama(2, vocab)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert parts_of(name, (vocab, HIDDEN), world, config) == [(0, *r) for r in rows]
    if world == 4 and vocab == 100:  # the embedded engine's even split differs
        assert part_range(vocab, 3, 4) == (75, 100)


def test_models_vllm_refuses_are_refused():
    with pytest.raises(ValueError, match="cannot split 6 heads or rows over 4 ranks"):
        vllm_part("model.layers.0.self_attn.q_proj.weight", (24, HIDDEN), 0, 4, {"num_attention_heads": 6})
    with pytest.raises(ValueError, match="cannot share 3 kv heads among 4 ranks"):
        vllm_part("model.layers.0.self_attn.k_proj.weight", (12, HIDDEN), 0, 4, llama(3))
    with pytest.raises(ValueError, match="cannot split a vocab padded to 128 over 3 ranks"):
        vllm_part("model.embed_tokens.weight", (100, HIDDEN), 0, 3, llama(1))


def random_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in expected_shapes(config).items()}


@pytest.mark.parametrize(("kv_heads", "world"), [(1, 4), (2, 4), (4, 2)])
def test_sharded_trainer_pieces_join_into_each_ranks_parts(kv_heads, world):
    """Three FSDP `Shard(0)` trainer ranks (rows as `part_range` gives them) each send what they hold of
    every vLLM rank's part; the joined parts are the full tensors' blocks and their sparse tensors hold
    them in place."""
    config = llama(kv_heads, vocab=520)
    state = random_state(config)
    part = functools.partial(vllm_part, config=config)
    trainers = 3
    received: list[list[dict]] = [[{} for _ in range(trainers)] for _ in range(world)]
    for t in range(trainers):
        for name, full in state.items():
            lo, hi = part_range(full.shape[0], t, trainers)
            for r, piece in enumerate(row_pieces(name, full[lo:hi], lo, tuple(full.shape), world, part)):
                if piece is not None:
                    received[r][t][name] = piece
    for r in range(world):
        sparse = SparseParts(config, r, world, fill=float("nan"))
        for into in (None, sparse.block):  # joined on their own, then straight into sparse full tensors
            parts = join_pieces(received[r], config, r, world, part, into=into)
            assert parts.keys() == state.keys()
            for name, got in parts.items():
                p = vllm_part(name, tuple(state[name].shape), r, world, config)
                want = state[name] if p is None else state[name].narrow(p[0], p[1], p[2] - p[1])
                assert torch.equal(got, want), (r, name)
        for name, full in sparse.tensors():
            p = vllm_part(name, tuple(state[name].shape), r, world, config)
            if p is not None:
                full = full.narrow(p[0], p[1], p[2] - p[1])
            assert not full.isnan().any() and torch.equal(full, parts[name]), (r, name)
    # a replicated trainer: rank 0 sends each vLLM rank its part, the others nothing
    assert trainer_pieces(state, 1, world, part) == [{}] * world
    pieces = trainer_pieces(state, 0, world, part)
    down = "model.layers.0.mlp.down_proj.weight"
    assert pieces[world - 1][down][1].shape == (HIDDEN, INTER // world)


def test_sparse_parts_place_each_block_in_a_full_tensor():
    config = llama(2, vocab=512)
    down, norm = "model.layers.0.mlp.down_proj.weight", "model.norm.weight"
    sparse = SparseParts(config, 1, 4, fill=float("nan"))
    block = sparse.block(down, (HIDDEN, INTER // 4), torch.float32)  # rank 1's quarter of the columns
    block.copy_(torch.ones(HIDDEN, INTER // 4))
    full = dict(sparse.tensors())[down]
    cols = slice(INTER // 4, INTER // 2)
    assert full.shape == (HIDDEN, INTER) and full[:, cols].eq(1).all()
    assert full[:, : INTER // 4].isnan().all() and full[:, INTER // 2 :].isnan().all()
    assert full.t().is_contiguous()  # a column block: written rows of a transposed buffer
    assert sparse.block(norm, (HIDDEN,), torch.float32).shape == (HIDDEN,)  # replicated: the whole tensor
    pool = BufferPool()  # a vLLM worker's, kept from one update to the next
    kept = SparseParts(config, 1, 4, buffers=pool)
    first = kept.block(down, (HIDDEN, INTER // 4), torch.float32)
    again = SparseParts(config, 1, 4, buffers=pool).block(down, (HIDDEN, INTER // 4), torch.float32)
    assert again.data_ptr() == first.data_ptr()  # the next update's block reuses the buffer


# -- against vLLM's layers ------------------------------------------------------------------------------
VLLM_CASES = [(w, kv, v) for w in (1, 2, 4) for kv in (1, 2, 4) for v in (512, 520, 100)]


@pytest.fixture(scope="module")
def vllm_layers():
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'tpuray[vllm]')")
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    return linear, vocab, parameter


def build(modules, world: int, rank: int, config: dict) -> dict[str, torch.nn.Module]:
    """vLLM's layers of one Llama layer as tensor-parallel rank `rank` of `world` builds them."""
    linear, vocab, parameter = modules
    with pytest.MonkeyPatch.context() as mp:
        for module in modules:
            mp.setattr(module, "get_tensor_model_parallel_world_size", lambda: world)
            mp.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
        f32 = {"params_dtype": torch.float32}
        kv, v = config["num_key_value_heads"], config["vocab_size"]
        return {
            "qkv": linear.QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, kv, bias=True, **f32),
            "o": linear.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=True, **f32),
            "gate_up": linear.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, **f32),
            "down": linear.RowParallelLinear(INTER, HIDDEN, bias=False, **f32),
            "embed": vocab.VocabParallelEmbedding(v, HIDDEN, **f32),
            "lm_head": vocab.ParallelLMHead(v, HIDDEN, **f32),
        }


DESTINATION = {  # HF name (after "model.layers.0.") -> (layer, param, shard id), as vLLM's Llama maps it
    "self_attn.q_proj": ("qkv", "q"),
    "self_attn.k_proj": ("qkv", "k"),
    "self_attn.v_proj": ("qkv", "v"),
    "self_attn.o_proj": ("o", None),
    "mlp.gate_proj": ("gate_up", 0),
    "mlp.up_proj": ("gate_up", 1),
    "mlp.down_proj": ("down", None),
    "model.embed_tokens": ("embed", None),
    "lm_head": ("lm_head", None),
}


def load(layers: dict[str, torch.nn.Module], tensors) -> None:
    """Call each parameter's vLLM weight loader (before `process_weights_after_loading`, which on the CPU
    backend may swap `weight` for a packed copy)."""
    for name, t in tensors:
        module, kind = name.removeprefix("model.layers.0.").rsplit(".", 1)
        if module.endswith("norm"):
            continue
        layer, shard = DESTINATION[module]
        param = getattr(layers[layer], kind)
        param.weight_loader(param, t, *(() if shard is None else (shard,)))


@pytest.mark.parametrize(("world", "kv_heads", "vocab"), VLLM_CASES)
def test_sparse_parts_load_like_full_tensors_into_vllm_layers(vllm_layers, world, kv_heads, vocab):
    config = llama(kv_heads, vocab)
    state = random_state(config, seed=world * 100 + kv_heads * 10 + vocab)
    o_bias = ("model.layers.0.self_attn.o_proj.bias", torch.randn(HIDDEN))  # Llama attention_bias
    part = functools.partial(vllm_part, config=config)
    pieces = trainer_pieces(state, 0, world, part)
    for rank in range(world):
        full = build(vllm_layers, world, rank, config)
        load(full, [*state.items(), o_bias])
        sparse = build(vllm_layers, world, rank, config)
        parts = SparseParts(config, rank, world, fill=float("nan"))
        join_pieces([pieces[rank]], config, rank, world, part, into=parts.block)
        assert part(o_bias[0], (HIDDEN,), rank, world) is None  # replicated: loaded whole
        load(sparse, [*parts.tensors(), o_bias])
        for layer, module in full.items():
            for pname, want in module.named_parameters():
                got = dict(sparse[layer].named_parameters())[pname]
                assert not got.isnan().any(), (rank, layer, pname)
                assert torch.equal(got, want), (rank, layer, pname)
        if world == 4 and kv_heads == 2 and rank == 3:  # q heads 6-7, then kv head 1 (k, v)
            qkv = full["qkv"].weight
            q = state["model.layers.0.self_attn.q_proj.weight"]
            k = state["model.layers.0.self_attn.k_proj.weight"]
            assert torch.equal(qkv[:8], q[24:32]) and torch.equal(qkv[8:12], k[4:8])
