"""Where a whole decode step's device time goes on a TPU, and which KV-cache layout and attention make it
shortest: the engine's compiled decode program (ModelRunner, its default backend: "tpu-donate" on a TPU)
of the 1.1B Llama that bench_real_tpu.py measures, at batch 1 and 32, context bucket 256, with parts of
the step swapped or removed. A variant is `cache+attention[+nowrite]`:

- cache: `slot` (the engine's [slots, positions, kv_heads, head_dim] per layer: a read is gathered and
  transposed to [B, kv_heads, L, head_dim]) or `head` ([slots, kv_heads, positions, head_dim]: read
  without a transpose);
- attention: `sdpa` (the engine's), `manual` (matmul, masked float32 softmax, matmul) or `none` (the
  attention output is the query: no cache read, no attention);
- `dense` (the engine's layout, written without a scatter: DenseWriteCache);
- `nowrite`: the step's K/V are not stored.

Both caches hold the same random keys/values, so the variants that attend compare logits with the first
one (`max_logit_diff`). Per variant and batch: `pipelined_ms` (steps launched back to back, the device's
own time per step) and `readback_ms` (each step's ids read back before the next launch).

    python3 benchmarks/tpu_decode_probe.py            # a TPU VM (. benchmarks/tpu_vm_env.sh)
    python benchmarks/tpu_decode_probe.py --device cpu --small --steps 3
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import tempfile
from pathlib import Path

import torch
from _tpu_engine import timed, write_llama

import tpuray.runtime as runtime
from tpuray.serve.llm.engine.embedded.kv_cache import KVCache
from tpuray.serve.llm.engine.embedded.runner import ModelRunner
from tpuray.serve.llm.engine.embedded.step_plan import decode_batches

VARIANTS = (
    "slot+sdpa,head+sdpa,slot+manual,head+manual,slot+none,head+none,slot+sdpa+nowrite,slot+none+nowrite"
)


class HeadMajorCache(KVCache):
    """The same cache with kv_heads before positions: [slots, kv_heads, positions, head_dim]."""

    def __init__(self, base: KVCache, device: torch.device):
        self.__dict__.update(base.__dict__)
        self.k = [t.transpose(1, 2).contiguous().to(device) for t in base.k]
        self.v = [t.transpose(1, 2).contiguous().to(device) for t in base.v]

    def write(self, layer, slots, positions, k, v) -> None:
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def read(self, layer, slots, length):
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]


class DenseWriteCache(KVCache):
    """The engine's layout written without a scatter: the first `length` positions of every slot are
    rewritten with `where` (a one-hot matmul places the rows' K/V), a static slice updated in place."""

    length = 256

    def __init__(self, base: KVCache):
        self.__dict__.update(base.__dict__)

    def _put(self, cache, hit, any_hit, x) -> None:
        S, L = hit.shape[:2]
        src = (hit.reshape(S * L, -1).to(x.dtype) @ x.reshape(x.shape[0], -1)).view(S, L, *x.shape[1:])
        cache[:, :L] = torch.where(any_hit[..., None, None], src, cache[:, :L])

    def write(self, layer, slots, positions, k, v) -> None:
        S, L, dev = self.k[layer].shape[0], self.length, slots.device
        hit = (torch.arange(S, device=dev)[:, None, None] == slots) & (
            torch.arange(L, device=dev)[None, :, None] == positions
        )  # [S, L, rows]
        any_hit = hit.any(-1)
        self._put(self.k[layer], hit, any_hit, k)
        self._put(self.v[layer], hit, any_hit, v)


class NoWriteCache(KVCache):
    def __init__(self, base: KVCache):
        self.__dict__.update(base.__dict__)

    def write(self, layer, slots, positions, k, v) -> None:
        pass


def manual_attention(q, k, v, mask):
    """GQA decode attention written out: q [B, H, T, D], k/v [B, KV, L, D], mask [B, 1, T, L]."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    qg = q.reshape(B, KV, (H // KV) * T, D)
    scores = (qg @ k.transpose(-1, -2)).float() * D**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return (probs @ v).reshape(B, H, T, D)


def variant_runner(base: ModelRunner, filled: KVCache, name: str) -> ModelRunner:
    cache, attention, *rest = name.split("+")
    r = copy.copy(base)
    r.model = copy.copy(base.model)  # shares the weights
    r.last_ids = base.last_ids.cpu().to(r.device)  # a device clone may share its buffer (donated)
    r.cache = HeadMajorCache(filled, r.device) if cache == "head" else copy.copy(filled)
    if cache in ("slot", "dense"):
        r.cache.k = [t.to(r.device) for t in filled.k]
        r.cache.v = [t.to(r.device) for t in filled.v]
    if cache == "dense":
        r.cache = DenseWriteCache(r.cache)
    if "nowrite" in rest:
        r.cache = NoWriteCache(r.cache)
    if attention == "manual":
        r.model._attention = manual_attention
    elif attention == "none":
        r.model._attention = lambda q, k, v, mask: q
    r._prefill, r._decode = r._prefill_program, r._decode_program
    if r.compiled:
        r._compile(r.backend)
    return r


def measure(r: ModelRunner, name: str, B: int, length: int, steps: int, reference: dict) -> dict:
    rows = [(s, [7 + s], 100 + 4 * s, None) for s in range(B)]
    packed = decode_batches(rows, list(range(B)), r.buckets, r.cache.trash_slot)[0].packed.to(r.device)
    logits = r._decode(packed, length)[0][:B].float().cpu()
    row: dict = {"variant": name, "batch": B, "backend": r.backend}
    if "none" not in name and "nowrite" not in name:
        reference.setdefault(B, logits)
        row["max_logit_diff"] = round(float((logits - reference[B]).abs().max()), 4)
    row["pipelined_ms"] = round(1e3 * timed(lambda: r._decode(packed, length), steps), 3)
    row["readback_ms"] = round(1e3 * timed(lambda: r._decode(packed, length)[1].cpu(), steps), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="tpu", choices=["tpu", "cpu"])
    ap.add_argument("--small", action="store_true", help="a 2-layer model (a check of the script)")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--length", type=int, default=256, help="the context bucket")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.device == "tpu":
        print(json.dumps({"runtime": runtime.activate()}), flush=True)
    if args.small:
        dims = dict(hidden=256, layers=2, heads=8, kv_heads=2, inter=512, vocab=1024)
    else:
        dims = dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, vocab=32000)
    path = Path(tempfile.mkdtemp()) / "llama"
    write_llama(path, **dims)
    base = ModelRunner(
        str(path),
        max_num_seqs=32,
        max_model_len=1024,
        dtype="bfloat16",
        device=args.device,
        compile=True if args.device == "tpu" else None,
    )
    gen = torch.Generator().manual_seed(0)
    filled = copy.copy(base.cache)
    # kept on the host: each variant copies it to the device anew (a donated buffer is gone, and torch_tpu
    # clone may share its buffer with the original)
    filled.k = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in base.cache.k]
    filled.v = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in base.cache.v]
    base.cache = None  # type: ignore[assignment]
    reference: dict[int, torch.Tensor] = {}
    for name in args.variants.split(","):
        r = variant_runner(base, filled, name)
        for B in (int(b) for b in args.batches.split(",")):
            print(json.dumps(measure(r, name, B, args.length, args.steps, reference)), flush=True)
        del r
        gc.collect()


if __name__ == "__main__":
    main()
