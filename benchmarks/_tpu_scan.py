"""The decoder's layers as one loop (torch's `scan`) against the engine's unrolled layers, for
bench_real_tpu.py (`scan-probe`): what each costs to compile, and to run, on the chip.

Why: the embedded engine's first start on the v5e spends ~18 s per step program (372 s for 19), most of
it in torch_tpu lowering the FX graph (it traces by running every op) and XLA compiling it, and a second
start ~1.2 s loading each saved executable (~29 MB). Both grow with the ops in a program, and the 1.1B
model's 16 layers repeat one body: written as one `torch.ops.higher_order.scan` over the layers' stacked
weights (torch_tpu 0.2.0 lowers it to a loop, `_internal/compile/scan.py`), a program holds the body
once. What it may cost: the loop's slicing of the stacked weights and caches at every layer, and the
K/V writes, which leave the loop (its body must not mutate what it reads) and go into the stacked cache
in one write over all layers after it.

For a decode of batch 1 and 32 over a context of `--max-model-len` and a 512-token prefill, each way
compiled with the engine's backend (tpu-donate on a TPU): the first call's seconds (trace, lower,
compile, run), the median step time, and whether the two ways agree (greedy ids, logits, the K/V rows
written). Decode batch 32 writes densely in both ways (the engine's TPU choice), batch 1 scatters.
With torch_tpu's tpu-donate, a third way: the unrolled step lowered with the MLIR location tracebacks
torch_tpu captures for every op of a compiled graph by default (`unrolled_tracebacks`; the engine's
backend lowers without them since the v5e showed their cost: first call ~2x, step time alike). And the scan way built
with torch.compile's aot_compile, saved and loaded back as the program store does for a second start
(`saved_*`: build, save and load seconds, bytes, whether its guards accept the inputs, its first run and
step time, and that it computes what the scan in memory does).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from _tpu_engine import first_and_median
from torch._higher_order_ops.scan import scan_op, wrap_combine_fn_flat

from tpuray.serve.llm.engine.embedded.kv_cache import KVCache, one_hot_places
from tpuray.serve.llm.engine.embedded.model import ShardedLlama, prefill_mask


def layer_loop(body: Callable, init: torch.Tensor, spec_xs: Any, leaves: list) -> tuple[Any, tuple]:
    """torch's scan of `body(carry, xs_slice) -> (carry, ys)` over dim 0 of the inputs whose leaves are
    `leaves` (their structure: `spec_xs`, from torch.utils._pytree outside any trace), called as torch's `scan_op` itself with the structure given, not found: the user-facing
    `scan` flattens its inputs with torch.utils._pytree under Dynamo, whose guards on pytree's registry a
    saved program cannot hold (aot_compile refuses them). Returns (final carry, ys leaves)."""
    combine = functools.partial(
        wrap_combine_fn_flat,
        combine_fn=body,
        spec_init=_LEAF,
        spec_xs=spec_xs,
        num_init_leaves=1,
        num_inp_leaves=len(leaves),
    )
    flat: list = []
    for out in scan_op(combine, [init], leaves, ()):  # eager: flat; under Dynamo: (carry, [ys])
        flat.extend(out if isinstance(out, (list, tuple)) else [out])
    return flat[0], tuple(flat[1:])


_LEAF = pytree.tree_flatten(torch.zeros(()))[1]


class ScanLlama:
    """ShardedLlama's math (one chip) with its layers in one scan: the layers' weights stacked [L, ...],
    the KV cache one tensor per K and V, [L, slots + 1, max_model_len, kv_heads, head_dim]."""

    def __init__(self, model: ShardedLlama, num_slots: int, max_model_len: int):
        self.m = model
        self.w = {k: torch.stack([layer[k] for layer in model.layers]) for k in model.layers[0]}
        shape = (model.num_layers, num_slots + 1, max_model_len, model.local_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self._spec_decode = pytree.tree_flatten((self.w, self.k, self.v))[1]  # outside any trace
        self._spec_prefill = pytree.tree_flatten(self.w)[1]

    def decode(self, tokens, positions, slots, context_len: int, dense: bool) -> torch.Tensor:
        m = self.m
        cos, sin = m._rope_tables(positions[:, None])
        cos, sin = cos[:, None], sin[:, None]
        key_pos = torch.arange(context_len, device=positions.device)
        mask = (key_pos[None, :] <= positions[:, None])[:, None, None]
        here = (key_pos[None, :] == positions[:, None])[:, None, :, None]  # [B, 1, L, 1]: the new token

        def body(h, xs):
            w, kc, vc = xs

            def attend(q, k, v):  # the cache's rows with this token's K/V in its place (not yet written)
                keys = torch.where(here, k, kc[slots, :context_len].transpose(1, 2))
                values = torch.where(here, v, vc[slots, :context_len].transpose(1, 2))
                return m._matmul_attention(q, keys, values, mask)

            h, k, v = m._layer(h, w, cos, sin, attend)  # the engine's layer, its weights a slice
            return h, (k[:, :, 0], v[:, :, 0])

        leaves = [*self.w.values(), self.k, self.v]
        h, (ks, vs) = layer_loop(body, m.embed[tokens][:, None], self._spec_decode, leaves)
        self._store(slots, positions, ks, vs, context_len if dense else None)
        return m._logits(h[:, 0])

    def prefill(self, tokens, positions, segments, slots, last) -> torch.Tensor:
        m = self.m
        cos, sin = m._rope_tables(positions)
        mask = prefill_mask(positions, segments)

        def body(h, w):
            h, k, v = m._layer(h, w, cos, sin, lambda q, k, v: m._attention(q, k, v, mask))
            return h, (k[0].transpose(0, 1), v[0].transpose(0, 1))

        h, (ks, vs) = layer_loop(body, m.embed[tokens][None], self._spec_prefill, [*self.w.values()])
        self._store(slots, positions, ks, vs, None)
        return m._logits(h[0][last])

    def _store(self, slots, positions, ks, vs, dense_length: int | None) -> None:
        """Every layer's rows [L, N, kv_heads, head_dim] into the stacked cache in one write: a scatter,
        or (`dense_length`) positions [0, length) of every slot rewritten, rows placed by a one-hot
        matmul (kv_cache.one_hot_places, as KVCache.dense_writer, over all layers at once)."""
        if dense_length is None:
            self.k[:, slots, positions] = ks
            self.v[:, slots, positions] = vs
            return
        S, n = self.k.shape[1], dense_length
        places, onehot = one_hot_places(S, n, slots, positions)
        written = places[None, ..., None, None]
        for cache, x in ((self.k, ks), (self.v, vs)):
            rows = (onehot.to(x.dtype) @ x.reshape(x.shape[0], x.shape[1], -1)).view(
                x.shape[0], S, n, *x.shape[2:]
            )
            cache[:, :, :n] = torch.where(written, rows, cache[:, :, :n])


def _compiled(fn, make_backend: Callable[[], Any] | None):
    """`fn` compiled with a backend of its own (a fresh one: Dynamo compiles it anew), or eager."""
    if make_backend is None:
        return fn
    return torch.compile(fn, backend=make_backend(), dynamic=False, fullgraph=True)


def probe(
    path, max_model_len: int, steps: int, device: str, make_backend: Any, make_traced: Any = None
) -> list[dict]:
    """Rows of `scan-probe`: one per step shape, each way against the unrolled one (`make_traced`: the
    backend of the unrolled_tracebacks way, or None for none)."""
    slots_n = 32
    model = ShardedLlama(path, dtype=torch.bfloat16, device=device, decode_attention="matmul")
    L, KV, D = model.num_layers, model.local_kv_heads, model.head_dim
    cache = KVCache(L, slots_n, KV, max_model_len, D, model.dtype, model.device)
    scanned = ScanLlama(model, slots_n, max_model_len)
    dev, rows = model.device, []
    for batch, dense in ((1, False), (32, True)):
        tokens = torch.arange(3, 3 + batch, device=dev)
        positions = torch.full((batch,), 7, device=dev)
        slots = torch.arange(batch, device=dev)
        context = min(256, max_model_len)

        def unrolled(t=tokens, p=positions, s=slots, d=dense, c=context):
            return model.decode(t, p, s, cache, c, dense_write=d)

        def looped(t=tokens, p=positions, s=slots, d=dense, c=context):
            return scanned.decode(t, p, s, c, d)

        ways = _ways(unrolled, looped, make_backend, make_traced)
        row = _compare(f"decode-b{batch}-ctx{context}", ways, steps, cache, scanned, slots, positions)
        owner = _Steps(scanned, context, dense)
        rows.append(
            row | _saved_row(_Steps.decode, owner, (tokens, positions, slots), make_backend, steps, ways)
        )
    T = min(512, max_model_len)
    tokens = torch.arange(3, 3 + T, device=dev) % model.vocab_size
    positions = torch.arange(T, device=dev)
    segments = torch.zeros(T, dtype=torch.long, device=dev)
    slots = torch.full((T,), slots_n - 1, device=dev)
    last = torch.tensor([T - 1], device=dev)
    ways = _ways(
        lambda: model.prefill(tokens, positions, segments, slots, last, cache),
        lambda: scanned.prefill(tokens, positions, segments, slots, last),
        make_backend,
        make_traced,
    )
    row = _compare(f"prefill-{T}", ways, steps, cache, scanned, slots[-1:], positions[-1:])
    args = (tokens, positions, segments, slots, last)
    rows.append(row | _saved_row(_Steps.prefill, _Steps(scanned), args, make_backend, steps, ways))
    return rows


def _saved_row(method, owner, args, make_backend, steps, ways) -> dict:
    """The scan way saved and loaded (`saved_program`): its parts' seconds, its first run and step time,
    and whether it computes what the scan way in memory does; an error is the figure. Nothing where the
    backend's programs cannot be saved (eager, or no backend)."""
    if make_backend is None:
        return {}
    try:
        run, figures = saved_program(method, owner, args, make_backend)
        first, ms, out = first_and_median(run, steps, contextlib.nullcontext)
        reference = ways["scan"][0]().float().cpu()
    except Exception as e:  # noqa: BLE001 - the exact error is the figure
        return {"saved_error": f"{type(e).__name__}: {e}"[:600]}
    diff = float((out.float().cpu() - reference).abs().max())
    return figures | {"saved_first_run_s": first, "saved_ms": ms, "saved_vs_scan_max_diff": diff}


class _Steps:
    """The scanned steps as methods of an object (what torch.compile's aot_compile saves: programs.py)."""

    def __init__(self, scanned: ScanLlama, context_len: int = 0, dense: bool = False):
        self.scanned, self.context_len, self.dense = scanned, context_len, dense

    def decode(self, tokens, positions, slots):
        return self.scanned.decode(tokens, positions, slots, self.context_len, self.dense)

    def prefill(self, tokens, positions, segments, slots, last):
        return self.scanned.prefill(tokens, positions, segments, slots, last)


def saved_program(method: Callable, owner: _Steps, args: tuple, make_backend: Callable) -> tuple[Any, dict]:
    """`method` built with aot_compile, saved to a file and loaded back as a second start would load it
    (programs.py; the load inside a throwaway tracing context: torch 2.13 installs a guard while it
    unpickles a scan program's guards); the loaded program's step and the seconds of each part."""
    import os
    import tempfile

    from torch._guards import TracingContext, tracing

    compiled = torch.compile(method, backend=make_backend(), dynamic=False, fullgraph=True)
    t0 = time.perf_counter()
    program = compiled.aot_compile(((owner, *args), {}))
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "program.bin")
        program.save_compiled_function(path)
        t2 = time.perf_counter()
        with open(path, "rb") as f, tracing(TracingContext(None)):
            loaded = torch.compiler.load_compiled_function(f)
        t3 = time.perf_counter()
        size = os.path.getsize(path)
    figures = dict(
        saved_build_s=t1 - t0,
        saved_save_s=t2 - t1,
        saved_load_s=t3 - t2,
        saved_bytes=size,
        saved_guards_accept=bool(loaded.guard_check(owner, *args)),
    )
    return functools.partial(loaded, owner, *args), figures


def _ways(unrolled, looped, make_backend, make_traced) -> dict[str, tuple[Any, Any]]:
    """Each way's (compiled step, context of its first call): unrolled, scan and, with tpu-donate,
    unrolled lowered with MLIR tracebacks."""
    ways = {
        "unrolled": (_compiled(unrolled, make_backend), contextlib.nullcontext),
        "scan": (_compiled(looped, make_backend), contextlib.nullcontext),
    }
    if make_traced is not None:
        ways["unrolled_tracebacks"] = (_compiled(unrolled, make_traced), contextlib.nullcontext)
    return ways


def _compare(name, ways, steps, cache, scanned, slots, positions) -> dict:
    """One shape's row: each way's first call and step time, the scan's agreement with the unrolled way
    (greedy ids, logits, K/V rows written); an error (a way failing to compile or run) is its figure."""
    row: dict[str, Any] = {"shape": name}
    logits = {}
    for way, (fn, first_context) in ways.items():
        try:
            first, ms, out = first_and_median(fn, steps, first_context)
        except Exception as e:  # noqa: BLE001 - the exact error is the figure
            row[f"{way}_error"] = f"{type(e).__name__}: {e}"[:600]
            continue
        row |= {f"{way}_first_call_s": first, f"{way}_ms": ms}
        logits[way] = out.float().cpu()
        if way != "unrolled" and "unrolled" in logits:
            row[f"{way}_first_call_ratio"] = first / row["unrolled_first_call_s"]
            row[f"{way}_step_ratio"] = ms / row["unrolled_ms"]
    if "unrolled" in logits and "scan" in logits:
        u, s = logits["unrolled"], logits["scan"]
        k_rows = torch.stack([cache.k[i][slots, positions] for i in range(len(cache.k))]).float().cpu()
        row |= dict(
            same_ids=bool(torch.equal(u.argmax(-1), s.argmax(-1))),
            logits_max_diff=float((u - s).abs().max()),
            k_rows_max_diff=float((k_rows - scanned.k[:, slots, positions].float().cpu()).abs().max()),
        )
    return row


def scan_probe(args, report: Any, checkpoint: Any) -> None:
    """bench_real_tpu.py `scan-probe`: the rows of `probe`, compiled with the first --compile-backend (on a
    CPU: eager, unless another backend is named)."""
    from tpuray.serve.llm.engine.embedded.tpu_compile import DONATING, donating_backend, lookup

    path, _ = checkpoint(args)
    name = args.compile_backend.split(",")[0]
    make = functools.partial(lookup, name) if args.device == "tpu" or name != "tpu-donate" else None
    traced = (
        functools.partial(donating_backend, name, mlir_tracebacks=True) if make and name in DONATING else None
    )
    for row in probe(path, args.max_model_len, args.steps, args.device, make, traced):
        report("scan_probe", backend=name if make else "eager", **row)
