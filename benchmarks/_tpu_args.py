"""bench_real_tpu.py's command line: the options of every subcommand, and their checks."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable


def parser(doc: str, decode_steps: Iterable[str], dims: Iterable[str]) -> argparse.ArgumentParser:
    """The script's parser (`h2d` adds its own options)."""
    decode_steps = list(decode_steps)
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "what",
        choices=[
            "engine",
            "prefill",
            "vllm",
            "vllm-weights",
            "vllm-handover",
            "train",
            "kv-write",
            "weights",
            "h2d",
            "scan-probe",
        ],
    )
    ap.add_argument("--device", default="tpu", help="tpu (default) or cpu (checks the script only)")
    ap.add_argument("--quick", action="store_true", help="engine: compile only the measured shapes")
    ap.add_argument("--small", action="store_true", help="a tiny model (checks the script only)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--compile-backend",
        default="tpu-donate",
        help="engine on a TPU: torch.compile backend(s), comma-separated, the first is the anchor "
        "(tpu-donate: the engine's default, the KV cache updated in place; tpu: torch_tpu's own; any "
        "torch.compile backend name)",
    )
    ap.add_argument(
        "--decode-step",
        default="auto",
        help=f"engine: decode step setups, comma-separated, crossed with the backends ({', '.join(decode_steps)})",
    )
    ap.add_argument("--parts", default="matmul,seed,gpt-eager,gpt-compiled", help="train: what to measure")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument(
        "--model-dir", default=None, help="engine, vllm, h2d: write the checkpoint here once, reuse it"
    )
    ap.add_argument("--dims", default="1b", choices=list(dims))
    ap.add_argument("--start-only", action="store_true", help="engine, vllm: measure the start, nothing else")
    ap.add_argument(
        "--load-workers",
        type=int,
        default=1,
        help="engine: threads reading saved programs at warm-up (runner.py)",
    )
    ap.add_argument(
        "--async-compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="engine: torch_tpu lowers and compiles the programs in background threads (runner.py; "
        "auto: where it applies)",
    )
    ap.add_argument("--mixed-runs", type=int, default=4, help="engine: serve_mixed runs (sync, async, ...)")
    ap.add_argument("--prompt-lens", default=None, help="prefill: prompt lengths, comma-separated (128,512)")
    ap.add_argument("--decode-batches", default="", help="prefill: decode batch sizes to split too (1,2,4)")
    ap.add_argument("--decode-positions", default="40", help="prefill: each decode row's position (40,600)")
    ap.add_argument(
        "--vllm-engine-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="vllm: more engine_kwargs, e.g. '{\"max_num_batched_tokens\": 1024}' (fewer compiled ranges)",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        metavar="S",
        help="Python's GIL switch interval for the run (sys.setswitchinterval; default 0.005): how often "
        "the main thread and torch_tpu's lowering threads trade the GIL",
    )
    ap.add_argument(
        "--sample-stacks",
        default=None,
        metavar="PATH",
        help="sample every thread's Python stack each 20 ms, from after the imports and the runtime's "
        "activation to the end, and write them to PATH (read: python3 benchmarks/_stacks.py PATH)",
    )
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace, decode_steps: Iterable[str]) -> None:
    """--decode-step's names, --switch-interval, --vllm-engine-kwargs (vllm only: an object), and
    prefill's comma-separated options as lists of integers (prompts and positions below
    --max-model-len)."""
    if args.switch_interval is not None and not args.switch_interval > 0:
        ap.error(f"--switch-interval {args.switch_interval} is not valid; valid: seconds > 0")
    if args.vllm_engine_kwargs is not None and (
        args.what != "vllm" or not isinstance(args.vllm_engine_kwargs, dict)
    ):
        ap.error(
            f"--vllm-engine-kwargs {json.dumps(args.vllm_engine_kwargs)} is not valid for {args.what!r}; "
            "valid: a JSON object, with `vllm`"
        )
    valid = list(decode_steps)
    unknown = set(args.decode_step.split(",")) - set(valid)
    if unknown:
        ap.error(f"--decode-step {', '.join(sorted(unknown))} is not valid; valid: {', '.join(valid)}")
    if args.what == "prefill":
        _prefill_lists(ap, args)


def _prefill_lists(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.prompt_lens = args.prompt_lens or f"128,{min(512, args.max_model_len - 1)}"
    for flag in ("prompt_lens", "decode_batches", "decode_positions"):
        text = getattr(args, flag)
        try:
            setattr(args, flag, [int(x) for x in text.split(",") if x])
        except ValueError:
            ap.error(f"--{flag.replace('_', '-')} {text!r} is not valid; valid: comma-separated integers")
    too_long = [n for n in args.prompt_lens + args.decode_positions if not 0 < n < args.max_model_len]
    if too_long:
        ap.error(
            f"prompt lengths and positions {too_long} are not valid; valid: 1 to {args.max_model_len - 1}"
        )
