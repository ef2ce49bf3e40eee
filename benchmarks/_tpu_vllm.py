"""vLLM-TorchTPU's measurements for bench_real_tpu.py (`vllm`, `vllm-weights`), on the same Llama-shaped
checkpoint as the embedded engine's (`_tpu_engine.write_llama`, plus a small tokenizer: prompts are token
ids), through tpuray's own vLLM engine (`VLLMEngine`, what a serving replica runs; `RolloutEngine` for the
weights), with vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process holds the
chip). Each function returns figures; the script reports them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ids = itertools.count()


def xla_programs() -> dict[str, float]:
    """torch_tpu's in-memory compilation cache: the XLA executables this process holds and the seconds
    spent compiling them (0 for one served from the persistent cache); {} where torch_tpu has no stats."""
    import torch

    try:
        entries = torch.tpu._get_cache_stats().per_entry_stats
    except (AttributeError, RuntimeError):
        return {}

    def secs(entry: Any) -> float:
        duration = getattr(entry, "compilation_duration", None)
        return float(duration.total_seconds()) if hasattr(duration, "total_seconds") else 0.0

    return {"xla_programs": len(entries), "xla_compile_s": sum(secs(e) for e in entries)}


def cache_files() -> dict[str, int]:
    """Files and bytes in the host's compilation cache (tpuray.serve.llm.engine.compile_cache)."""
    from tpuray.serve.llm.engine.compile_cache import cache_dir

    root = cache_dir()
    files = [p for p in root.rglob("*") if p.is_file()] if root is not None and root.exists() else []
    return {"cache_files": len(files), "cache_bytes": sum(p.stat().st_size for p in files)}


def compile_stats(engine: Any) -> dict[str, Any]:
    """Where a start's compile time went: the KV cache's block count (part of vLLM-TorchTPU's compile key),
    vLLM's compilation counters (AOT artifacts compiled or loaded, graphs compiled), torch's AOTAutograd
    cache counters and the seconds of Dynamo's phases (tracing, the backend: lowering and XLA together)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    from vllm.compilation.counter import compilation_counter as c

    phases = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler", "build_guards")
    return {
        "kv_blocks": engine.vllm_config.cache_config.num_gpu_blocks,
        "vllm_aot_compiles": c.num_aot_compiles,
        "vllm_aot_loaded": c.num_aot_artifacts_loaded,
        "vllm_graphs_compiled": c.num_cache_entries_updated,
        "aot_autograd": dict(counters["aot_autograd"]),
        "dynamo_s": {k: round(sum(compilation_time_metrics.get(k, [])), 2) for k in phases},
    }


def add_tokenizer(path: Path) -> None:
    """vLLM's OpenAI layer needs a tokenizer; the bench sends token ids (the model's vocab is larger).
    Written once beside the checkpoint: a second start finds it, as it finds the weights."""
    if (path / "tokenizer_config.json").exists():
        return
    from tpuray.models import build_tokenizer

    build_tokenizer().save_pretrained(str(path))


def vllm_config(path: Path, max_model_len: int, max_num_seqs: int, extra: dict | None = None):
    """`extra`: more engine_kwargs (the bench's --vllm-engine-kwargs), over the defaults."""
    from tpuray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": "llama-1b", "model_source": str(path)},
        llm_engine="vLLM",
        # the engine_kwargs a RolloutConfig gives (vllm_weights): one set of compiled programs for both
        engine_kwargs={
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "dtype": "bfloat16",
            **(extra or {}),
        },
    )


def start_vllm(
    path: Path, max_model_len: int, max_num_seqs: int, extra: dict | None = None
) -> tuple[Any, dict]:
    """tpuray's VLLMEngine for the checkpoint (vLLM compiles its programs while it starts)."""
    from tpuray.serve.llm.engine.vllm.engine import VLLMEngine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    engine = VLLMEngine(vllm_config(path, max_model_len, max_num_seqs, extra))
    took = time.perf_counter() - t0
    return engine, {"start_s": took, "where": engine.where(), **xla_programs(), **compile_stats(engine)}


def _params(max_tokens: int, temperature: float = 0.0) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def _one(client: Any, prompt: list[int], params: Any) -> list[int]:
    final = None
    async for out in client.generate({"prompt_token_ids": prompt}, params, f"bench-{next(_ids)}"):
        final = out
    assert final is not None
    return list(final.outputs[0].token_ids)


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 500 + 2 for j in range(n)]  # distinct per i: no prefix-cache hits


def _run(loop: asyncio.AbstractEventLoop, client: Any, prompts: list[list[int]], params: list[Any]) -> float:
    async def together() -> list[list[int]]:
        return await asyncio.gather(*(_one(client, p, sp) for p, sp in zip(prompts, params, strict=True)))

    t = time.perf_counter()
    outs = loop.run_until_complete(together())
    took = time.perf_counter() - t
    assert all(len(o) == sp.max_tokens for o, sp in zip(outs, params, strict=True)), [len(o) for o in outs]
    return took


def vllm_figures(engine: Any, weight_bytes: int, hbm_bytes_per_s: float, requests: int) -> dict:
    """Batch-1 and batch-32 decode, TTFT of a 512-token prompt, mixed requests (programs built while
    serving counted from torch_tpu's cache) and 16 greedy tokens (to compare engines)."""
    loop, client, out = asyncio.new_event_loop(), engine.client, {}
    run = lambda prompts, params: _run(loop, client, prompts, params)  # noqa: E731
    run([_prompt(1, 16)], [_params(8)])  # first request: untimed
    ttft16 = statistics.median(run([_prompt(20 + r, 16)], [_params(1)]) for r in range(5))
    run([_prompt(2, 512)], [_params(1)])
    out["ttft512_ms"] = 1e3 * statistics.median(run([_prompt(30 + r, 512)], [_params(1)]) for r in range(5))
    run([_prompt(4, 16)], [_params(256)])
    b1 = min(run([_prompt(5 + r, 16)], [_params(256)]) for r in range(3))
    out["decode_batch1_tokens_per_s"] = 255 / (b1 - ttft16)
    out["fraction_of_roofline"] = out["decode_batch1_tokens_per_s"] / (hbm_bytes_per_s / weight_bytes)
    run([_prompt(100 + i, 16) for i in range(32)], [_params(128)] * 32)
    b32 = min(run([_prompt(200 + 32 * r + i, 16) for i in range(32)], [_params(128)] * 32) for r in range(2))
    out["decode_batch32_tokens_per_s"] = 32 * 128 / b32
    out["batch32_vs_batch1"] = out["decode_batch32_tokens_per_s"] / out["decode_batch1_tokens_per_s"]
    rng = random.Random(0)  # the embedded engine's serve_mixed distribution (sampled ones unseeded here)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 512))] for _ in range(requests)]
    params = [_params(rng.randrange(1, 64), 0.0 if i % 4 else 0.8) for i in range(requests)]
    before = xla_programs()
    mixed = run(prompts, params)
    after = xla_programs()
    tokens = sum(p.max_tokens for p in params)
    out |= {
        "mixed_requests": requests,
        "mixed_tokens": tokens,
        "mixed_s": mixed,
        "mixed_tokens_per_s": tokens / mixed,
    }
    out["programs_built_while_serving"] = after.get("xla_programs", -1) - before.get("xla_programs", 0)
    out["greedy_tokens"] = loop.run_until_complete(_one(client, list(range(3, 40)), _params(16)))
    loop.close()
    return out


def update_split(engine: Any, state: dict, steps: int) -> dict[str, Any]:
    """Where `update_weights` goes on an in-process engine (the VM's: a state dict staged as tensors, as
    `VLLMRolloutEngine._load_update` does there): the median seconds of its phases, each awaited on the
    chip (the driver's check of names and shapes; staging on the worker; the commit, vLLM's layer-wise
    reload; vLLM's prefix-cache reset), and inside the commit the count and seconds of vLLM-TorchTPU's
    synchronizations (`synchronize_tensors`, one per linear layer after its weight is transposed; means
    per commit)."""
    from _tpu_engine import synced

    from tpuray.rl.weights.check import check_state, shapes_of

    client, run = engine._engine.client, engine._loop.run
    phases = {
        "check_s": lambda: check_state(shapes_of(state), engine.model_config),
        "stage_s": lambda: run(client.collective_rpc("tpuray_stage_tensors", args=(dict(state),))),
        "commit_s": lambda: run(client.collective_rpc("tpuray_commit_weights")),
        "reset_s": lambda: run(client.reset_prefix_cache()),
    }
    times: dict[str, list[float]] = {k: [] for k in phases}
    with counted_syncs() as syncs:
        for _ in range(steps):
            for k, fn in phases.items():  # stage before commit: each commit loads the update just staged
                times[k].append(synced(fn)[0])
    per_commit = {k: v / steps for k, v in syncs.items()}
    return {f"update_{k}": statistics.median(v) for k, v in times.items()} | per_commit


@contextlib.contextmanager
def counted_syncs() -> Iterator[dict[str, float]]:
    """Counts and times vLLM-TorchTPU's `synchronize_tensors` in its unquantized linear method while the
    block runs ({"syncs": calls, "sync_s": seconds}; empty where vLLM-TorchTPU is not installed)."""
    try:
        from vllm_torchtpu.layers.adapter.quantization import unquantized
    except ImportError:
        yield {}
        return
    real, seen = unquantized.synchronize_tensors, {"syncs": 0.0, "sync_s": 0.0}

    def timed_sync(*args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        real(*args, **kwargs)
        seen["syncs"] += 1
        seen["sync_s"] += time.perf_counter() - t

    unquantized.synchronize_tensors = timed_sync
    try:
        yield seen
    finally:
        unquantized.synchronize_tensors = real


def vllm_weights(path: Path, state: dict, steps: int, device: str, report: Any) -> dict:
    """A vLLM rollout engine (tpuray.rl.RolloutEngine) on the checkpoint: its start (reported at once; its
    vLLM configuration differs from `vllm`'s serving one, e.g. its worker extension, so vLLM compiles its
    own programs), `update_weights` of the full bf16 state dict against the raw host-to-chip transfer of
    the same bytes (timed first, before vLLM reserves most of the chip's memory), and what `sleep()` says."""
    from _tpu_engine import timed

    from tpuray.rl import RolloutConfig, rollout_engine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"weight_bytes": nbytes}
    out["raw_to_device_s"] = timed(lambda: [t.to(device) for t in state.values()], steps)
    report("vllm_weights_raw", **out)
    t0 = time.perf_counter()
    config = RolloutConfig(str(path), engine="vllm", max_model_len=1024, max_num_seqs=32, dtype="bfloat16")
    engine = rollout_engine(config)
    report("vllm_weights_start", start_s=time.perf_counter() - t0, **xla_programs())
    try:
        out["update_s"] = timed(lambda: engine.update_weights(state), steps)
        out["update_vs_raw"] = out["update_s"] / out["raw_to_device_s"]
        out["update_gb_s"] = nbytes / out["update_s"] / 1e9
        out |= update_split(engine, state, steps)
        try:
            engine.sleep()
            out["sleep"] = "slept"
            engine.wake_up()
        except Exception as e:  # noqa: BLE001 - the exact error is the figure
            out["sleep"] = f"{type(e).__name__}: {e}"
    finally:
        engine.shutdown()
    return out
