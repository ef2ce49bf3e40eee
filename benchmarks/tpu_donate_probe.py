"""Does a compiled program update a KV cache where it lies on a TPU? Each variant writes one position of a
cache from inside a compiled program and reads a few positions back; the probe checks that the write is
seen and kept (and nothing else changed) over three calls on a small cache, then times a call on a 1 GiB
cache (the engine's 1.1B model has a 1.1 GB cache), against a program that only reads.

Variants (`--variants`, comma-separated):
- `tpu`: torch_tpu's backend (the mutation copied back after the program: the engine's path until now);
- `tpu-donate`: src/tpuray/serve/llm/engine/embedded/tpu_compile.py (the mutated cache donated to the
  program, so XLA updates it in place; the engine's default on a TPU since);
- `functional`: no mutation at all: the program returns the new cache, its input donated, and the caller
  keeps the returned tensor;
- `eager`: index_put_ outside any program (torch_tpu's eager mode);
- `read_only`: the same program without the write (the floor: launch + read back);
- `layouts`: a decode step's writes alone into the engine's 1.1 GB cache, per layer (32 scatters) or
  stacked across layers (2 scatters), donated: does a scatter cost per row (`--rows 32`)?

    python3 benchmarks/tpu_donate_probe.py                   # a TPU VM (. benchmarks/tpu_vm_env.sh)
    python3 benchmarks/tpu_donate_probe.py --variants layouts --rows 32    # batch 32's writes
    python benchmarks/tpu_donate_probe.py --device cpu --variants eager,read_only
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import per_call

import tpuray.runtime as runtime
from tpuray.serve.llm.engine.embedded.tpu_compile import lookup

SMALL = (3, 16, 2, 4)
BIG = (64, 4096, 16, 128)  # bf16: 1 GiB


def report(variant: str, **figures) -> None:
    print(json.dumps({"variant": variant, **figures}), flush=True)


def _functional_backend():
    """Donate the graph inputs shaped like the cache (the program returns the new cache)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch_tpu._internal.compile import compiler

    def backend(gm, example_inputs, **kwargs):
        static = compiler.StaticCompiler()

        def forward(graph, inputs):
            donated = [i for i, t in enumerate(inputs) if tuple(t.shape) in (SMALL, BIG)]
            return static(graph, inputs, True, donated_inputs=donated, module_name="probe")

        return aot_autograd(fw_compiler=forward, keep_inference_input_mutations=False)(gm, example_inputs)

    return backend


def make_step(variant: str):
    """(step(cache, slots, pos, k) -> (cache, read)): the cache to keep using and a small read."""

    def mutate(cache, slots, pos, k):
        cache.index_put_((slots, pos), k)
        return cache[slots, :8].clone()

    def functional(cache, slots, pos, k):
        new = cache.index_put((slots, pos), k)
        return new, new[slots, :8].clone()

    def read_only(cache, slots, pos, k):
        return cache[slots, :8] + k.sum()

    if variant == "eager":
        return lambda c, s, p, k: (c, mutate(c, s, p, k))
    if variant == "functional":
        fn = torch.compile(functional, backend=_functional_backend(), dynamic=False, fullgraph=True)
        return fn
    body = read_only if variant == "read_only" else mutate
    fn = torch.compile(
        body, backend=lookup("tpu" if variant == "read_only" else variant), dynamic=False, fullgraph=True
    )
    return lambda c, s, p, k: (c, fn(c, s, p, k))


def check(variant: str, device: torch.device) -> None:
    step = make_step(variant)
    cache = torch.zeros(SMALL, device=device)
    slots = torch.tensor([0], device=device)
    for trial in range(3):
        pos = torch.tensor([trial + 2], device=device)
        k = torch.full((1, SMALL[2], SMALL[3]), float(trial + 1), device=device)
        cache, read = step(cache, slots, pos, k)
        read = read.cpu()
    whole = cache.cpu()
    kept = all(bool((whole[0, t + 2] == t + 1).all()) for t in range(3))
    report(
        variant, check=True, read_sees_write=bool((read[0, 4] == 3).all()), cache_keeps_writes=kept,
        elsewhere_sum=float(whole.abs().sum() - sum(whole[0, t + 2].abs().sum() for t in range(3))),
    )  # fmt: skip


def timed(variant: str, device: torch.device, calls: int, rows: int = 1) -> None:
    step = make_step(variant)
    cache = torch.zeros(BIG, dtype=torch.bfloat16, device=device)
    slots = torch.arange(rows, device=device)
    k = torch.ones((rows, BIG[2], BIG[3]), dtype=torch.bfloat16, device=device)
    state = {"cache": cache}

    def call(pos: torch.Tensor) -> torch.Tensor:
        state["cache"], read = step(state["cache"], slots, pos, k)
        return read.cpu()

    _, figures = per_call(call, lambda i: (torch.full((rows,), i % 8, device=device),), calls)
    report(variant, rows=rows, cache_gib=cache.numel() * 2 / 2**30, **figures)


LAYERS, SLOTS, MAX_LEN, KV, D = 16, 33, 1024, 8, 64  # the 1.1B engine's cache: 1.1 GB of bf16 K and V


def cache_layouts(device: torch.device, calls: int, rows: int, only: list[str]) -> None:
    """A decode step's cache writes alone, donated (`tpu-donate`), in two layouts of the same 1.1 GB:
    `per_layer` (the engine's: one [slots, positions, heads, dim] tensor per layer for K and for V, so 32
    scatters of `rows` rows per step), `head` (the same with heads before positions), `stacked` ([slots,
    positions, layers, heads, dim] for K and for V: 2 scatters of `rows` windows of every layer) and
    `flat` (one [slots * positions, 2, layers, heads, dim]: 1 scatter, one index per row). Does a scatter
    cost per row it writes?"""
    backend = lookup("tpu-donate" if device.type == "tpu" else "eager")  # CPU: checks the script only

    def per_layer(ks, vs, slots, pos, k, v):
        for i in range(LAYERS):
            ks[i].index_put_((slots, pos), k[:, i])
            vs[i].index_put_((slots, pos), v[:, i])
        return k.sum()

    def stacked(kc, vc, slots, pos, k, v):
        kc.index_put_((slots, pos), k)
        vc.index_put_((slots, pos), v)
        return k.sum()

    def head(ks, vs, slots, pos, k, v):
        for i in range(LAYERS):
            ks[i][slots, :, pos] = k[:, i]
            vs[i][slots, :, pos] = v[:, i]
        return k.sum()

    def flat(kv, slots, pos, k, v):  # one [slots * positions, 2, layers, heads, dim]: one row index
        kv.index_copy_(0, slots * MAX_LEN + pos, torch.stack([k, v], dim=1))
        return k.sum()

    def per_layer_rows(ks, vs, slots, pos, k, v):  # one single-row write per row: XLA's dynamic-update-slice?
        for i in range(LAYERS):
            for j in range(rows):
                ks[i][slots[j : j + 1], pos[j : j + 1]] = k[j : j + 1, i]
                vs[i][slots[j : j + 1], pos[j : j + 1]] = v[j : j + 1, i]
        return k.sum()

    def stacked_rows(kc, vc, slots, pos, k, v):
        for j in range(rows):
            kc[slots[j : j + 1], pos[j : j + 1]] = k[j : j + 1]
            vc[slots[j : j + 1], pos[j : j + 1]] = v[j : j + 1]
        return k.sum()

    slots = torch.arange(rows, device=device)
    k = torch.ones((rows, LAYERS, KV, D), dtype=torch.bfloat16, device=device)
    layouts = {
        "per_layer": (per_layer, (SLOTS, MAX_LEN, KV, D), LAYERS),
        "head": (head, (SLOTS, KV, MAX_LEN, D), LAYERS),
        "stacked": (stacked, (SLOTS, MAX_LEN, LAYERS, KV, D), 1),
        "flat": (flat, (SLOTS * MAX_LEN, 2, LAYERS, KV, D), 1),
        "per_layer_rows": (per_layer_rows, (SLOTS, MAX_LEN, KV, D), LAYERS),
        "stacked_rows": (stacked_rows, (SLOTS, MAX_LEN, LAYERS, KV, D), 1),
    }
    layouts = {name: v for name, v in layouts.items() if not only or name in only}
    for name, (body, shape, n) in layouts.items():
        ks = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(n)]
        vs = [
            torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(n if name != "flat" else 0)
        ]
        fn = torch.compile(body, backend=backend, dynamic=False, fullgraph=True)
        args = (ks, vs) if n > 1 else (ks[0],) if name == "flat" else (ks[0], vs[0])
        _, figures = per_call(
            lambda pos, fn=fn, args=args: fn(*args, slots, pos, k, k).cpu(),
            lambda i: (torch.full((rows,), i % 8, device=device),),
            calls,
        )
        report(f"layout_{name}", rows=rows, median_ms=figures["median_ms"], best_ms=figures["best_ms"])
        del ks, vs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="tpu", choices=["tpu", "cpu"])
    ap.add_argument("--variants", default="read_only,tpu,tpu-donate,functional,eager")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--layouts", default="", help="the layouts variant's layouts (default: all)")
    ap.add_argument("--rows", type=int, default=1, help="rows written per call (the decode batch)")
    args = ap.parse_args()
    if args.device == "tpu":
        print(json.dumps({"runtime": runtime.activate()}), flush=True)
    device = torch.device(args.device)
    variants = args.variants.split(",")
    if "layouts" in variants:
        variants.remove("layouts")
        try:
            cache_layouts(device, args.calls, args.rows, args.layouts.split(",") if args.layouts else [])
        except Exception as e:  # says why; the other variants still run
            report("layouts", error=f"{type(e).__name__}: {e}"[:500])
    for variant in variants:
        for probe in (check, timed):
            try:
                probe(variant, device) if probe is check else probe(variant, device, args.calls, args.rows)
            except Exception as e:  # a variant that cannot run says why; the others still run
                report(variant, probe=probe.__name__, error=f"{type(e).__name__}: {e}"[:500])


if __name__ == "__main__":
    main()
