"""Where a reused KV-cache slot goes wrong on a TPU (benchmarks/tpu_slot_reuse.py): probes, each compiled
for the device and compared with the CPU in float32 (highest matmul precision). A check, not a timing.

1. `write_read`: a program that writes one position of a cache with index_put_ and then reads the slot
   back: does the read see the write, and does the cache keep it?
2. `masked_sdpa`: the engine's grouped-query decode attention with a boolean mask, keys beyond the mask
   filled with large values: does the mask hold?
3. `lockstep`: the compiled runner against the CPU runner (eager), fed the same tokens: the largest logit
   difference of every step, in slot 0, slot 0 again, a fresh slot, and a slot whose positions beyond
   the sequence hold garbage.

Found on a TPU v5e with torch_tpu 0.2.0 (2026-12-04): `write_read` holds; `masked_sdpa` fails with the
decode mask as the engine built it ([B, 1, 1, L], broadcast over the query rows: max difference 0.81
from the CPU, 1,001 with large keys beyond the mask; an additive float mask of that shape too) and holds
with the mask expanded to the scores' shape or a hand-written softmax (1.3e-6); the model now expands
it, and `lockstep` agrees to 1.1e-6 in every slot (docs/real-tpu.md, "A reused cache slot").

    python3 benchmarks/tpu_cache_probe.py                    # a TPU VM (. benchmarks/tpu_vm_env.sh)
    python benchmarks/tpu_cache_probe.py --device cpu        # the same probes compiled for the CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from _tpu_engine import write_llama

import tpuray.runtime as runtime
from tpuray.serve.llm.engine.embedded.runner import ModelRunner


def report(name: str, **figures) -> None:
    print(json.dumps({"probe": name, **figures}), flush=True)


def write_read(device: torch.device, backend: str) -> None:
    def step(cache, slots, pos, k, length: int):
        cache.index_put_((slots, pos), k)
        return cache[slots, :length].clone()

    fn = torch.compile(step, backend=backend, dynamic=False, fullgraph=True)
    cache = torch.zeros(3, 16, 2, 4, device=device)
    slots, pos = torch.tensor([0], device=device), torch.tensor([5], device=device)
    for trial in range(3):
        k = torch.full((1, 2, 4), float(trial + 1), device=device)
        read = fn(cache, slots, pos, k, 8).cpu()
        report(
            "write_read", trial=trial, read_sees_write=bool((read[0, 5] == trial + 1).all()),
            cache_keeps_write=bool((cache[0, 5].cpu() == trial + 1).all()),
            cache_elsewhere=float(cache.cpu().abs().sum() - cache[0, 5].cpu().abs().sum()),
        )  # fmt: skip


def _decode_attention(variant: str):
    """The engine's decode attention (q [B, H, 1, D], k/v [B, KV, L, D], query heads stacked per KV head),
    its mask of `positions` [B] built one of several ways."""
    import torch.nn.functional as F

    def attend(q, k, v, positions, length: int):
        key_pos = torch.arange(length, device=positions.device)
        mask = (key_pos[None, :] <= positions[:, None])[:, None, None]  # [B, 1, 1, L]
        B, H, T, D = q.shape
        KV = k.shape[1]
        q = q.reshape(B, KV, H // KV * T, D)
        if variant == "expanded":
            mask = mask.expand(B, KV, H // KV * T, length)
        elif variant == "additive":
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        if variant == "manual":
            scores = (q @ k.transpose(-1, -2)) * D**-0.5
            out = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.reshape(B, H, T, D)

    return attend


def masked_sdpa(device: torch.device, backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 8, 1, 32), (2, 2, 64, 32), (2, 2, 64, 32)))
    positions = torch.tensor([9, 20])
    want_fn = _decode_attention("broadcast")
    for variant in ("broadcast", "expanded", "additive", "manual"):
        fn = torch.compile(_decode_attention(variant), backend=backend, dynamic=False, fullgraph=True)
        for fill in (0.0, 1e3):
            k2, v2 = k.clone(), v.clone()
            for b, p in enumerate(positions.tolist()):
                k2[b, :, p + 1 :], v2[b, :, p + 1 :] = fill, fill
            want = want_fn(q, k2, v2, positions, 64)
            got = fn(*(t.to(device) for t in (q, k2, v2, positions)), 64).cpu()
            report("masked_sdpa", mask=variant, beyond_mask=fill, max_diff=float((got - want).abs().max()))


def lockstep(device: torch.device, backend: str | None, path: Path, tokens: int) -> None:
    kw = dict(max_num_seqs=4, max_model_len=128, dtype="float32")
    cpu = ModelRunner(str(path), **kw)
    chip = ModelRunner(str(path), device=device.type, compile=True, compile_backend=backend, **kw)
    prompt = list(range(3, 40))
    for slot in (2,):  # garbage beyond the sequence: a stale slot, made obvious
        for cache in (cpu.cache, chip.cache):
            for t in (*cache.k, *cache.v):
                t[slot, len(prompt) :] = 50.0
    for label, slot in (("slot 0", 0), ("slot 0 again", 0), ("fresh slot 1", 1), ("garbage slot 2", 2)):
        want = cpu.step([(slot, prompt, 0, None)])
        got = chip.step([(slot, prompt, 0, None)])
        assert want is not None and want.logits is not None and got is not None and got.logits is not None
        diffs, ids = [float((got.logits - want.logits).abs().max())], [want.token_ids[0]]
        agree = [got.token_ids == want.token_ids]
        for i in range(tokens):
            step = [(slot, [ids[-1]], len(prompt) + i, None)]
            want, got = cpu.step(step), chip.step(step)
            assert want is not None and want.logits is not None and got is not None and got.logits is not None
            diffs.append(float((got.logits - want.logits).abs().max()))
            agree.append(got.token_ids == want.token_ids)
            ids.append(want.token_ids[0])
        n = len(prompt) + tokens
        cache_diff = max(
            float((a[slot, :n].cpu() - b[slot, :n]).abs().max())
            for a, b in zip((*chip.cache.k, *chip.cache.v), (*cpu.cache.k, *cpu.cache.v), strict=True)
        )
        report(
            "lockstep", run=label, max_logit_diff=[float(f"{d:.2e}") for d in diffs], argmax_agrees=agree,
            cache_diff_in_sequence=float(f"{cache_diff:.2e}"), compilations=chip.compilations,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="tpu", choices=["tpu", "cpu"])
    ap.add_argument("--backend", default=None, help="compile backend (default: tpu on a TPU, else inductor)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--probes", default="write_read,masked_sdpa,lockstep")
    args = ap.parse_args()
    if args.device == "tpu":
        print(json.dumps({"runtime": runtime.activate()}))
    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)
    backend = args.backend or ("tpu" if args.device == "tpu" else "inductor")
    probes = args.probes.split(",")
    for name, probe in (("write_read", write_read), ("masked_sdpa", masked_sdpa)):
        if name in probes:
            try:
                probe(device, backend)
            except Exception as e:  # a probe that cannot run says why; the others still run
                report(name, error=f"{type(e).__name__}: {e}"[:400])
    if "lockstep" in probes:
        path = Path(tempfile.mkdtemp()) / "llama"
        write_llama(path, hidden=256, layers=2, heads=8, kv_heads=2, inter=512, vocab=1024)
        lockstep(device, backend, path, args.tokens)


if __name__ == "__main__":
    main()
