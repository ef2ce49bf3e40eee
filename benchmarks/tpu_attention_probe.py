"""Where a batch-32 decode step's device time goes on a TPU: the engine's decode attention alone (16 layers
of a 1.1B Llama's shapes: 32 query heads, 8 KV heads, head_dim 64, a 33-slot x 1,024-position bf16 cache
per layer for K and for V), compiled, with the keys read from the cache and attended to in several ways:

- reading: `index` (the engine's `cache[slots, :L]`), `index_select` (`cache[:, :L].index_select(0,
  slots)`), `onehot` (a one-hot [B, slots] matmul over the cache's first L positions), `slice` (the first
  B slots, no indexing at all: the floor);
- attending: `sdpa` (the engine's F.scaled_dot_product_attention with the mask expanded to the scores'
  shape), `manual` (matmul, masked float32 softmax, matmul).

Prints the median ms per call (20 calls after 3) per combination, at batch 1 and 32, and the largest
difference from `index`+`sdpa` (a check that each variant computes the same attention).

    python3 benchmarks/tpu_attention_probe.py               # a TPU VM (. benchmarks/tpu_vm_env.sh)
    python benchmarks/tpu_attention_probe.py --device cpu --batches 2 --layers 2
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _common import per_call

import tpuray.runtime as runtime

SLOTS, MAX_LEN, HEADS, KV, D = 33, 1024, 32, 8, 64


def read(how: str, cache: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """Keys of `slots` [B], positions [0, length): [B, KV, L, D]."""
    if how == "index":
        out = cache[slots, :length]
    elif how == "index_select":
        out = cache[:, :length].index_select(0, slots)
    elif how == "onehot":
        onehot = F.one_hot(slots, cache.shape[0]).to(cache.dtype)  # [B, S]
        out = (onehot @ cache[:, :length].reshape(cache.shape[0], -1)).view(len(slots), length, KV, D)
    else:  # slice: the first B slots
        out = cache[: len(slots), :length]
    return out.transpose(1, 2)


def attend(how: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, 1, D], k/v [B, KV, L, D], mask [B, 1, 1, L] (True: attend) -> [B, H, 1, D]."""
    B, G = q.shape[0], HEADS // KV
    qg = q.reshape(B, KV, G, D)
    full = mask.expand(B, KV, G, k.shape[2])
    if how == "sdpa":
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=full)
    else:
        scores = (qg @ k.transpose(-1, -2)).float() * D**-0.5
        probs = scores.masked_fill(~full, float("-inf")).softmax(-1).to(v.dtype)
        out = probs @ v
    return out.reshape(B, HEADS, 1, D)


def program(reading: str, attending: str, length: int):
    def run(ks, vs, q, slots, positions):
        mask = (torch.arange(length, device=q.device)[None, :] <= positions[:, None])[:, None, None]
        total = torch.zeros_like(q)
        for k, v in zip(ks, vs, strict=True):
            total = total + attend(
                attending, q, read(reading, k, slots, length), read(reading, v, slots, length), mask
            )
        return total

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="tpu", choices=["tpu", "cpu"])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--length", type=int, default=256, help="the context bucket L")
    ap.add_argument(
        "--combos",
        default="index+sdpa,index+manual,index_select+manual,onehot+manual,slice+sdpa,slice+manual",
    )
    args = ap.parse_args()
    if args.device == "tpu":
        print(json.dumps({"runtime": runtime.activate()}), flush=True)
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):  # one compiled program per combination and batch
            setattr(torch._dynamo.config, name, 256)
    device, backend = torch.device(args.device), ("tpu" if args.device == "tpu" else "eager")
    gen = torch.Generator().manual_seed(0)
    ks = [
        torch.randn(SLOTS, MAX_LEN, KV, D, generator=gen).to(torch.bfloat16).to(device)
        for _ in range(args.layers)
    ]
    vs = [
        torch.randn(SLOTS, MAX_LEN, KV, D, generator=gen).to(torch.bfloat16).to(device)
        for _ in range(args.layers)
    ]
    for B in (int(b) for b in args.batches.split(",")):
        q = torch.randn(B, HEADS, 1, D, generator=gen).to(torch.bfloat16).to(device)
        slots = torch.randperm(SLOTS - 1, generator=gen)[:B].to(device)
        positions = torch.randint(1, args.length, (B,), generator=gen).to(device)
        reference = None
        for combo in args.combos.split(","):
            reading, attending = combo.split("+")
            try:
                fn = torch.compile(program(reading, attending, args.length), backend=backend, dynamic=False)
                inputs = (ks, vs, q, slots, positions)
                out, figures = per_call(lambda *a, fn=fn: fn(*a).float().cpu(), lambda i, x=inputs: x, 20)
                if reference is None:
                    reference = out
                row = {"batch": B, "combo": combo, "median_ms": figures["median_ms"]}
                if reading != "slice":
                    row["max_diff_vs_first"] = round(float((out - reference).abs().max()), 4)
                print(json.dumps(row), flush=True)
            except Exception as e:  # one combination that cannot run says why; the others still run
                print(
                    json.dumps({"batch": B, "combo": combo, "error": f"{type(e).__name__}: {e}"[:400]}),
                    flush=True,
                )


if __name__ == "__main__":
    main()
