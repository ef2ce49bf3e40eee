"""A Llama-family decoder that runs one tensor-parallel shard of a Hugging Face checkpoint.

Megatron-style sharding over `world_size` ranks: q/k/v and gate/up are column-parallel (each rank holds
its own attention heads / FFN columns), o_proj and down_proj are row-parallel and their partial outputs are
summed with `all_reduce` over the process group (tpu_dist on TPU slices). Embeddings, norms and lm_head
are replicated, so every rank ends with the full logits. With world_size 1 it is a plain Llama forward.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from tpuray.serve.llm.engine.embedded.kv_cache import KVCache

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

DecodeAttention = Literal["sdpa", "matmul"]
"""How a decode step attends: "sdpa" (F.scaled_dot_product_attention) or "matmul" (two matmuls around a
float32 softmax: on a TPU 0.9 vs 4.1 ms per batch-32 step of the 1.1B model, benchmarks/README.md; on a CPU
slower)."""


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def prefill_mask(positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T]: token i attends to token j of its own segment at an earlier or equal position."""
    same = segments[:, None] == segments[None, :]
    return (same & (positions[None, :] <= positions[:, None]))[None, None]


def _model_config(path: str | Path) -> dict[str, Any]:
    """The model's config.json, refused (ValueError naming what is valid) unless the engine runs it."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {cfg.get('model_type')!r} is not supported by the embedded engine; "
            f"valid: {', '.join(SUPPORTED_MODEL_TYPES)} (install vLLM for other models)"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported; valid: 'default'")
    return cfg


class ShardedLlama:
    layers: list[dict[str, torch.Tensor]]  # this rank's shard of each decoder layer (_load_shard)

    def __init__(
        self,
        path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        decode_attention: DecodeAttention = "sdpa",
    ):
        if decode_attention not in ("sdpa", "matmul"):
            raise ValueError(f"decode_attention={decode_attention!r} is not valid; valid: 'sdpa', 'matmul'")
        self.decode_attention = decode_attention
        cfg = _model_config(path)
        self._read_dims(cfg, world_size)
        self.rank, self.world_size = rank, world_size
        self.local_heads, self.local_kv_heads = self.heads // world_size, self.kv_heads // world_size
        self.device = torch.device(device)
        self.all_reduce = all_reduce
        if dtype is None:
            dtype = getattr(
                torch, str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32
            )
        self.dtype = dtype
        self._load_shard(load_state_dict(path))
        for name, t in list(self.__dict__.items()):
            if isinstance(t, torch.Tensor):
                setattr(self, name, t.to(self.device))
        self.layers = [{k: v.to(self.device) for k, v in layer.items()} for layer in self.layers]
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.inv_freq = inv.to(self.device)

    def _read_dims(self, cfg: dict[str, Any], world_size: int) -> None:
        """The model's dimensions from its config.json; each sharded one divides by `world_size`."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        self.theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.num_layers = cfg["num_hidden_layers"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.vocab_size = cfg["vocab_size"]
        self.max_position_embeddings = cfg.get("max_position_embeddings", 2048)
        for name, n in (
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("intermediate_size", cfg["intermediate_size"]),
        ):
            if n % world_size:
                raise ValueError(f"tensor_parallel_size={world_size} must divide {name}={n}")

    def _load_shard(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shard of the weights in `state`: q/k/v and gate/up fused, column- or row-parallel."""
        dtype, rank, world_size = self.dtype, self.rank, self.world_size

        def get(name: str) -> torch.Tensor:
            return state[name].to(dtype)

        def rows(t: torch.Tensor) -> torch.Tensor:  # column-parallel: split output features
            return t.chunk(world_size, dim=0)[rank]

        def cols(t: torch.Tensor) -> torch.Tensor:  # row-parallel: split input features
            return t.chunk(world_size, dim=1)[rank]

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.lm_head = state.get("lm_head.weight", state["model.embed_tokens.weight"]).to(dtype)
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "in_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                # q, k, v fused into one column-parallel matmul of this rank's heads
                "qkv": torch.cat([rows(get(p + f"self_attn.{x}_proj.weight")) for x in "qkv"]),
                "o": cols(get(p + "self_attn.o_proj.weight")),
                "gate_up": torch.cat(
                    [rows(get(p + "mlp.gate_proj.weight")), rows(get(p + "mlp.up_proj.weight"))]
                ),
                "down": cols(get(p + "mlp.down_proj.weight")),
            }
            biases = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if all(b in state for b in biases):  # qwen2-style attention bias
                layer["qkv_bias"] = torch.cat([rows(get(b)) for b in biases])
            self.layers.append(layer)

    def new_kv_cache(self, num_slots: int, max_model_len: int) -> KVCache:
        return KVCache(
            self.num_layers,
            num_slots,
            self.local_kv_heads,
            max_model_len,
            self.head_dim,
            self.dtype,
            self.device,
        )

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., head_dim] of integer positions [...]."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Grouped-query attention without copying K/V per query head: q [B, H, T, D], k/v [B, KV, L, D],
        mask [b, 1, T, L] (b 1 or B) -> [B, H, T, D]. The G = H / KV query heads that share a KV head are
        stacked along the rows ([B, KV, G*T, D]), which is the same attention as repeating K/V G times
        (head h reads KV head h // G) but reads each K/V once."""
        B, H, T, D = q.shape
        KV = k.shape[1]
        groups = H // KV
        if mask.shape[-2] > 1 and groups > 1:  # row g*T + t of a group is token t's row
            mask = mask.repeat(1, 1, groups, 1)
        # the mask expanded to the scores' full shape: torch_tpu 0.2.0 ignores a mask that broadcasts
        # over the query rows (a decode's [B, 1, 1, L]; the cache probe, benchmarks/notes/real-tpu.md)
        mask = mask.expand(B, KV, groups * T, k.shape[2])
        out = F.scaled_dot_product_attention(q.reshape(B, KV, groups * T, D), k, v, attn_mask=mask)
        return out.reshape(B, H, T, D)

    def _matmul_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """`_attention` written out (matmul, masked float32 softmax, matmul); the same shapes."""
        B, H, T, D = q.shape
        KV = k.shape[1]
        if mask.shape[-2] > 1 and H > KV:
            mask = mask.repeat(1, 1, H // KV, 1)
        scores = (q.reshape(B, KV, (H // KV) * T, D) @ k.transpose(-1, -2)).float() * D**-0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
        return (probs @ v).reshape(B, H, T, D)

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The decoder stack over hidden states [B, T, hidden]; `attend(layer, q, k, v)` as `_layer`'s."""
        for i, layer in enumerate(self.layers):
            h = self._layer(h, layer, cos, sin, functools.partial(attend, i))[0]
        return h

    def _layer(
        self,
        h: torch.Tensor,
        layer: dict[str, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer over hidden states [B, T, hidden] with its weights `layer`: the new hidden
        states and this step's k/v [B, KV, T, D] (RoPE applied), which `attend(q, k, v)` takes with q
        [B, H, T, D] to store k/v and return the attention output [B, H, T, D]."""
        B, T, _ = h.shape
        H, KV, D = self.local_heads, self.local_kv_heads, self.head_dim
        x = self._rms(h, layer["in_norm"])
        qkv = x @ layer["qkv"].T
        if "qkv_bias" in layer:
            qkv = qkv + layer["qkv_bias"]
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q = self._rope(q.view(B, T, H, D).transpose(1, 2), cos, sin)
        k = self._rope(k.view(B, T, KV, D).transpose(1, 2), cos, sin)
        v = v.view(B, T, KV, D).transpose(1, 2)
        out = attend(q, k, v).transpose(1, 2).reshape(B, T, H * D) @ layer["o"].T
        if self.all_reduce is not None:
            self.all_reduce(out)
        h = h + out
        x = self._rms(h, layer["post_norm"])
        gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ layer["down"].T
        if self.all_reduce is not None:
            self.all_reduce(out)
        return h + out, k, v

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms(h, self.norm) @ self.lm_head.T

    @torch.no_grad()
    def prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: torch.Tensor,
        slots: torch.Tensor,
        last_index: torch.Tensor,
        cache: KVCache,
        all_positions: bool = False,
    ) -> torch.Tensor:
        """Prompts packed in one row: token i of [T] is at `positions[i]` of sequence `segments[i]`, whose
        K/V go to cache slot `slots[i]` (padding: a segment of its own, the trash slot). A token attends
        to the earlier tokens of its own segment only. Returns the logits of the tokens at `last_index`
        [P] (each prompt's last token): [P, vocab]; with `all_positions`, of every token: [T, vocab]."""
        cos, sin = self._rope_tables(positions)  # [T, D]
        mask = prefill_mask(positions, segments)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(i, slots, positions, k[0].transpose(0, 1), v[0].transpose(0, 1))
            return self._attention(q, k, v, mask)

        h = self._layers(self.embed[tokens][None], cos, sin, attend)[0]  # [T, hidden]
        return self._logits(h if all_positions else h[last_index])

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        context_len: int,
        dense_write: bool = False,
    ) -> torch.Tensor:
        """One new token per sequence: token [B] at `positions` [B] of cache slot `slots` [B], attending
        to positions [0, context_len) of its slot (context_len > every position). Logits [B, vocab].
        `dense_write`: the K/V stored with the cache's dense writer instead of a scatter (kv_cache.py)."""
        cos, sin = self._rope_tables(positions[:, None])  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D]
        key_pos = torch.arange(context_len, device=positions.device)
        mask = (key_pos[None, :] <= positions[:, None])[:, None, None]  # [B, 1, 1, L]

        dense = cache.dense_writer(slots, positions, context_len) if dense_write else None
        attention = self._matmul_attention if self.decode_attention == "matmul" else self._attention

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if dense is None:
                cache.write(i, slots, positions, k[:, :, 0], v[:, :, 0])
            else:
                dense(i, k[:, :, 0], v[:, :, 0])
            keys, values = cache.read(i, slots, context_len)
            return attention(q, keys, values, mask)

        h = self._layers(self.embed[tokens][:, None], cos, sin, attend)
        return self._logits(h[:, 0])
