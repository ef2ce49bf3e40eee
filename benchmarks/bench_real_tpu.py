"""tpuray on a real TPU chip (issue 20): the serving engine compiled for XLA, training through tpuray's
helpers vs raw torch_tpu, and the chip's bf16 matmul ceiling. One process, no Ray (a TPU VM runs it
alone: see docs/real-tpu.md for the set-up).

    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py engine     # the embedded engine, ~1B Llama
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py vllm       # vLLM-TorchTPU, same model
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py vllm-weights   # RL: update_weights into vLLM
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py vllm-handover  # RL: colocated vLLM hand-over
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py train      # matmul ceiling + train steps
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py weights    # RL: updates, sleep / wake-up
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py h2d --dims 1b-hd128   # host-to-chip paths
    PYTHONPATH=...:src python3 benchmarks/bench_real_tpu.py scan-probe --dims 1b-hd128  # layers as a loop
    python3 benchmarks/bench_real_tpu.py engine --small --device cpu   # the script itself, on a CPU

Prints one JSON line per measurement (and writes them to --out). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import _tpu_h2d as h2d
import torch
from _stacks import Sampler
from _tpu_args import check, parser
from _tpu_colocated import vllm_handover
from _tpu_engine import (
    bench_kv_write,
    bench_prefill,
    decode_rate,
    decode_split,
    greedy_tokens,
    live_bytes,
    loop_rate,
    serve_mixed,
    sync,
    timed,
    write_llama,
)
from _tpu_scan import scan_probe
from _tpu_train import bench_train
from _tpu_vllm import add_tokenizer, cache_files, start_vllm, vllm_figures, vllm_weights, xla_programs

V5E_HBM_BYTES_PER_S = 819e9
RESULTS: list[dict] = []
OUT: list[str] = []  # --out
ENGINE_DIMS = {
    "small": dict(hidden=256, layers=2, heads=8, kv_heads=2, inter=512, vocab=1024),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, vocab=32000),  # Llama-3.2-1B-like
    # the same weight bytes with head_dim 128 (vLLM-TorchTPU 0.29's head_dim-64 kernel fails on it here)
    "1b-hd128": dict(hidden=2048, layers=16, heads=16, kv_heads=4, inter=8192, vocab=32000),
}


def report(name: str, **fields) -> None:
    row = {"name": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    if OUT:  # at once: a run stopped at its time limit keeps what it measured
        with open(OUT[0], "a") as f:
            f.write(json.dumps(row) + "\n")


def since_process_start(args=None) -> float:
    """Seconds since this process started (a start's figure counts Python's imports too), less the
    seconds `checkpoint` spent writing the model into an empty --model-dir (`args.checkpoint_written_s`):
    that is the benchmark's set-up, not the engine's start."""
    import psutil

    written = getattr(args, "checkpoint_written_s", 0.0)
    return time.time() - psutil.Process().create_time() - written


def checkpoint(args) -> tuple[Path, int]:
    """The Llama-shaped checkpoint (random bf16 weights), written once into --model-dir and reused: a
    second start of an engine finds the same model at the same path. Returns (path, weight bytes)."""
    name = "small" if args.small else args.dims
    dims = ENGINE_DIMS[name]
    path = Path(args.model_dir or tempfile.mkdtemp()) / name
    done = path / "weight_bytes.txt"
    if not done.exists():
        t0 = time.perf_counter()
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(str(write_llama(path, **dims)))
        args.checkpoint_written_s = getattr(args, "checkpoint_written_s", 0.0) + time.perf_counter() - t0
    return path, int(done.read_text())


# -- the engine ------------------------------------------------------------------------------------------
def bench_engine(args) -> None:
    """Each backend in --compile-backend in turn, on the same checkpoint; the figures of every backend
    after the first are also reported as ratios to the first's (the anchor)."""
    import gc

    path, weight_bytes = checkpoint(args)
    backends = args.compile_backend.split(",") if args.device == "tpu" else [None]
    setups = [(b, d) for b in backends for d in args.decode_step.split(",")]
    anchor: dict[str, float] = {}
    anchor_tokens = None
    for backend, decode_step in setups:
        figures = engine_figures(args, path, weight_bytes, backend, DECODE_STEPS[decode_step])
        if args.start_only:
            return
        tokens = figures.pop("greedy_tokens")
        if not anchor:
            anchor, anchor_tokens = figures, tokens
        else:
            report(
                "engine_vs_anchor",
                backend=backend,
                decode_step=decode_step,
                anchor=f"{setups[0][0]} {setups[0][1]}",
                same_greedy_tokens=tokens == anchor_tokens,
                **{f"{k}_ratio": v / anchor[k] for k, v in figures.items() if anchor.get(k)},
            )
        gc.collect()


def both_modes(rate) -> tuple[float, float]:
    """`rate(ahead)` synchronous and with async scheduling, each the best of two alternated runs (the
    order and the host's noise favour neither)."""
    runs = [(ahead, rate(ahead)) for ahead in (False, True, False, True)]
    return max(r for a, r in runs if not a), max(r for a, r in runs if a)


DECODE_STEPS = {  # the runner options of --decode-step's names
    "auto": {},  # the engine's choice (on a TPU: K/V written densely from batch 16, matmul attention)
    "scatter-sdpa": {"kv_write": "scatter", "decode_attention": "sdpa"},  # the engine until 2026-12-05
}


def engine_figures(args, path: Path, weight_bytes: int, backend: str | None, options: dict) -> dict:
    from tpuray.serve.llm.engine.embedded.runner import ModelRunner

    max_model_len, max_num_seqs = args.max_model_len, 32
    t0 = time.perf_counter()
    runner = ModelRunner(
        str(path),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype="bfloat16",
        device=args.device,
        compile=True if args.device == "tpu" else None,
        compile_backend=backend,
        load_workers=args.load_workers,
        async_compile={"auto": None, "on": True, "off": False}[args.async_compile],
        **options,
    )
    load_s = time.perf_counter() - t0
    built = 0 if args.quick else runner.warmup()
    background = bool(runner.programs and runner.programs.async_compile)
    xla = xla_programs()
    if background and "xla_compile_s" in xla:  # torch_tpu's threads record no compile time: not measured
        xla["xla_compile_s"] = None
    report(
        "engine_start",
        backend=backend,
        kv_write=runner.kv_write,
        decode_attention=runner.model.decode_attention,
        params_bytes=weight_bytes,
        kv_cache_bytes=runner.cache.nbytes,
        load_s=load_s,
        warmup_s=runner.warmup_s,
        warmup_phases_s=runner.warmup_phases,
        programs=built,
        loaded_programs=runner.loaded_programs,
        load_workers=runner.load_workers,
        async_compile=background,
        buckets=runner.buckets.num_programs,
        compiled=runner.compiled,
        since_process_start_s=since_process_start(args),
        checkpoint_written_s=getattr(args, "checkpoint_written_s", 0.0),
        **xla,
        **cache_files(),
    )
    if args.start_only:
        return {}
    roofline = V5E_HBM_BYTES_PER_S / weight_bytes
    # synchronous (each step read back before the next) and async scheduling (launched ahead) side by side
    b1, b1a = both_modes(lambda ahead: decode_rate(runner, 1, args.steps, ahead=ahead))
    report(
        "decode_batch1",
        backend=backend,
        tokens_per_s=b1,
        roofline_tokens_per_s=roofline,
        fraction_of_roofline=b1 / roofline,
        async_tokens_per_s=b1a,
        async_fraction_of_roofline=b1a / roofline,
        async_vs_sync=b1a / b1,
    )
    loop, loopa = both_modes(lambda ahead: loop_rate(runner, args.steps, ahead, max_num_seqs, max_model_len))
    report(
        "decode_batch1_scheduler_loop",
        backend=backend,
        tokens_per_s=loop,
        async_tokens_per_s=loopa,
        async_fraction_of_roofline=loopa / roofline,
        async_vs_sync=loopa / loop,
    )
    b32, b32a = both_modes(lambda ahead: decode_rate(runner, 32, args.steps, ahead=ahead))
    report(
        "decode_batch32",
        backend=backend,
        tokens_per_s=b32,
        vs_batch1=b32 / b1,
        async_tokens_per_s=b32a,
        async_vs_sync=b32a / b32,
    )
    for batch in (1, 32):
        report("decode_split", backend=backend, **decode_split(runner, batch, args.steps))
    prompt = list(range(3, 3 + min(512, max_model_len)))
    runner.step([(0, prompt, 0, None)], need_logits=False)  # untimed
    times = []
    for _ in range(5):
        t = time.perf_counter()
        runner.step([(0, prompt, 0, None)], need_logits=False)
        times.append(time.perf_counter() - t)
    ttft = sorted(times)[2] * 1e3
    report("ttft", backend=backend, prompt_tokens=len(prompt), ms_median=ttft)
    figures = {"decode_batch1_tokens_per_s": b1, "decode_batch32_tokens_per_s": b32, "ttft_ms": ttft}
    figures |= {"decode_batch1_async_tokens_per_s": b1a, "decode_batch32_async_tokens_per_s": b32a}
    figures["greedy_tokens"] = greedy_tokens(runner)
    ahead_tokens = greedy_tokens(runner, mode="ahead")
    report("greedy_async_vs_sync", backend=backend, same_tokens=ahead_tokens == figures["greedy_tokens"])
    if not args.quick:
        for ahead in (False, True, False, True)[: args.mixed_runs]:  # alternated: the first also warms up
            mixed = serve_mixed(runner, args.requests, max_num_seqs, max_model_len, ahead=ahead)
            report("serve_mixed", backend=backend, **mixed)
            key = "serve_mixed_async_s" if ahead else "serve_mixed_s"
            figures[key] = min(figures.get(key, mixed["seconds"]), mixed["seconds"])
    return figures


# -- vLLM-TorchTPU beside it -----------------------------------------------------------------------------------
def bench_vllm(args) -> None:
    """vLLM-TorchTPU through tpuray's VLLMEngine on the same checkpoint as `engine` (its start, with the
    compilation cache as found; then the figures `engine` reports for the embedded engine)."""
    path, weight_bytes = checkpoint(args)
    add_tokenizer(path)
    engine, start = start_vllm(path, args.max_model_len, 32, args.vllm_engine_kwargs)
    try:
        extra = {"engine_kwargs": args.vllm_engine_kwargs} if args.vllm_engine_kwargs else {}
        written = getattr(args, "checkpoint_written_s", 0.0)
        report(
            "vllm_start",
            since_process_start_s=since_process_start(args),
            checkpoint_written_s=written,
            **start,
            **extra,
            **cache_files(),
        )
        if not args.start_only:
            report("vllm", **vllm_figures(engine, weight_bytes, V5E_HBM_BYTES_PER_S, args.requests))
    finally:
        engine.shutdown()


def bench_vllm_weights(args) -> None:
    """RL through vLLM-TorchTPU (tpuray.rl.RolloutEngine): update_weights of the full bf16 state dict
    against the raw host-to-chip transfer of the same bytes; sleep()."""
    from tpuray.serve.llm.engine.embedded.model import load_state_dict

    path, _ = checkpoint(args)
    add_tokenizer(path)
    state = load_state_dict(path)
    report("vllm_weights", **vllm_weights(path, state, args.steps, args.device, report))


def bench_vllm_handover(args) -> None:
    """RL with vLLM colocated in this process (_tpu_colocated.py): --steps hand-overs (sleep, the full
    state dict while asleep, wake-up), each step timed, the greedy tokens checked after each."""
    from tpuray.serve.llm.engine.embedded.model import load_state_dict

    path, _ = checkpoint(args)
    add_tokenizer(path)
    vllm_handover(path, load_state_dict(path), args.steps, args.device, report)


# -- RL: the rollout engine's weight updates and sleep / wake-up ---------------------------------------------
def bench_weights(args) -> None:
    """A one-chip rollout engine (`tpuray.rl.rollout.embedded_worker.RunnerWeights` over a `ModelRunner`, as RolloutEngine
    runs it in process) taking a full bf16 state dict from the host: stage (check, cut, fuse on the host)
    + commit (copy into the weights on the chip), and the same bytes as received pieces staged as row
    blocks (`tpuray.rl.weights.rows`: one host-to-chip copy per block into its rows), against the raw transfer
    of the same bytes (each tensor `.to(chip)`: fresh buffers) and an in-place copy into the same tensors (`copy_`: what commit does);
    then colocated hand-overs (sleep, an update while asleep, wake-up) at sleep level 1 (weights copied
    to the host) once, and at level 2 (discarded) with the trainer's weights on the chip taken over the
    host (stage + commit of the full state, as the object store delivers it) or handed over in process
    (`tpuray.rl.sync.handover`: cut and fused on the chip, adopted at wake-up), alternated; with the
    allocator's count of live bytes on the device."""
    from tpuray.rl.rollout.embedded_worker import RunnerWeights
    from tpuray.rl.weights.join import assemble
    from tpuray.rl.weights.layout import engine_tensors
    from tpuray.serve.llm.engine.embedded.model import load_state_dict
    from tpuray.serve.llm.engine.embedded.runner import ModelRunner

    dims = ENGINE_DIMS["small" if args.small else "1b"]
    path = Path(tempfile.mkdtemp()) / "llama"
    weight_bytes = write_llama(path, **dims)
    runner = ModelRunner(str(path), max_num_seqs=4, max_model_len=256, dtype="bfloat16", device=args.device)
    weights = RunnerWeights(runner, path, rank=0, world_size=1)
    state = load_state_dict(path)
    shards = {k: t.cpu() for k, t in engine_tensors(runner.model).items()}
    dev = engine_tensors(runner.model)

    def update() -> None:
        weights.stage(state)
        weights.commit()

    def in_place() -> None:
        with torch.no_grad():
            for k, t in dev.items():
                t.copy_(shards[k])

    halves = two_senders(state)

    def rows_update() -> None:  # received pieces staged as row blocks, committed block by block
        weights.stage_shards(assemble(halves, weights.config, 0, 1, deferred=True))
        weights.commit()

    raw = timed(lambda: [t.to(args.device) for t in shards.values()], args.steps)
    figures = dict(
        raw_to_device_s=raw,
        in_place_s=timed(in_place, args.steps),
        update_s=timed(update, args.steps),
        rows_update_s=timed(rows_update, args.steps),
    )
    report(
        "rl_update",
        weight_bytes=weight_bytes,
        **figures,
        update_gb_s=weight_bytes / figures["update_s"] / 1e9,
        update_vs_raw=figures["update_s"] / raw,
        in_place_vs_raw=figures["in_place_s"] / raw,
        rows_vs_raw=figures["rows_update_s"] / raw,
    )
    live = live_bytes(args.device)
    report("rl_handover", level=1, path="host", **handover(weights, update, 1, live))
    # the trainer's weights on the chip: over the host (the object store's path: stage + commit of the
    # full state from the host) against the in-process hand-over (tpuray.rl.sync.handover: cut and fused on
    # the chip, adopted at wake-up), alternated
    on_chip = {k: t.to(args.device) for k, t in state.items()}
    for path in ("host", "in_process", "host", "in_process"):
        take = update if path == "host" else (lambda: hand_over(weights, on_chip))
        report("rl_handover", level=2, path=path, **handover(weights, take, 2, live))


def two_senders(state: dict) -> list[dict]:
    """The pieces of a one-rank engine's update as two trainer ranks of an FSDP2 run send them (each
    tensor's rows split between them; on the host, as a transfer leaves them)."""
    from tpuray.rl.weights.cut import trainer_pieces

    senders: list[dict] = [{}, {}]
    for name, (start, t) in trainer_pieces(state, 0, 1)[0].items():
        half = t.shape[0] // 2
        senders[0][name] = (start, t[:half])
        if half < t.shape[0]:
            senders[1][name] = (start + half, t[half:])
    return senders


def hand_over(weights, on_chip) -> None:
    """A colocated rank's in-process hand-over of the trainer's weights `on_chip` (`tpuray.rl.sync.handover`:
    what weight_sync="tpu_dist" does colocated), taken by the engine rank (stage + commit)."""
    from tpuray.rl.sync import handover

    handover.keep("bench", handover.rank_shards(on_chip, 0, 1, weights.config))
    weights.stage_pieces([handover.Handed("bench")])
    weights.commit()


def handover(weights, take, level: int, live) -> dict:
    """One colocated hand-over (the engine's side of an RLRun iteration): sleep at `level`, an update of
    the full state taken while asleep (`take`: stage + commit), wake-up; seconds of each, bytes freed."""
    before = live()
    t0 = time.perf_counter()
    freed = weights.sleep(level)
    sync()
    t1, asleep = time.perf_counter(), live()
    take()
    sync()
    t2 = time.perf_counter()
    retaken = weights.wake_up()
    sync()
    t3 = time.perf_counter()
    assert retaken == freed
    return dict(
        freed_bytes=freed,
        device_bytes_awake=before,
        device_bytes_asleep=asleep,
        sleep_s=t1 - t0,
        update_asleep_s=t2 - t1,
        wake_up_s=t3 - t2,
        total_s=t3 - t0,
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("tpuray").setLevel(logging.INFO)  # progress of long work (the warm-up's programs)
    ap = parser(__doc__, DECODE_STEPS, [k for k in ENGINE_DIMS if k != "small"])
    h2d.add_options(ap)
    args = ap.parse_args()
    OUT[:] = [args.out] if args.out else []
    check(ap, args, DECODE_STEPS)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.what == "h2d" and h2d.starts_settings():  # a process per setting holds the chip, not this one
        if args.sample_stacks or args.switch_interval:
            ap.error(
                "--sample-stacks and --switch-interval apply to this process; h2d with settings measures in one process each"
            )
        return h2d.run_settings(args, report, checkpoint)
    if args.device == "tpu":
        from tpuray.runtime import activate

        imported_s = since_process_start()  # Python, torch and this script's imports
        mode = activate()
        report(
            "runtime",
            mode=mode,
            imported_s=imported_s,
            activated_s=since_process_start(),
            switch_interval_s=sys.getswitchinterval(),
        )
    commands = {"engine": bench_engine, "prefill": lambda a: bench_prefill(a, report, checkpoint)}
    commands["vllm"] = bench_vllm
    commands["vllm-weights"] = bench_vllm_weights
    commands["vllm-handover"] = bench_vllm_handover
    commands |= {
        "train": lambda a: bench_train(a, report),
        "kv-write": lambda a: bench_kv_write(a, report),
        "weights": bench_weights,
        "h2d": lambda a: h2d.run_paths(a, report, checkpoint),
        "scan-probe": lambda a: scan_probe(a, report, checkpoint),
    }
    sampler = Sampler(args.sample_stacks) if args.sample_stacks else None
    try:
        commands[args.what](args)
    finally:
        if sampler is not None:
            sampler.stop()


if __name__ == "__main__":
    main()
