"""Greedy tokens of one prompt run again and again in the same KV-cache slot of the embedded engine's
compiled runner: every run must give the same tokens (a check, not a timing).

Modes, in this order: "sync" (each step's ids read back, then the next step launched), "waited" (the
next step takes its token from the device, FROM_DEVICE, after the previous step finished), "ahead"
(async scheduling: launched before the previous step is read back), "sync" again, then "sync" in a
fresh slot. On a TPU v5e with torch_tpu 0.2.0 (2026-12-04) the first "sync" run and every later run in
the same slot differed within the first five tokens, whatever the mode, while on CPU all runs agreed:
torch_tpu ignored the decode attention mask, so a reused slot's stale keys leaked in (found with
benchmarks/tpu_cache_probe.py, fixed in the model; after the fix all five runs agree on the chip).

    python3 benchmarks/tpu_slot_reuse.py                     # a TPU VM (. benchmarks/tpu_vm_env.sh)
    python benchmarks/tpu_slot_reuse.py --device cpu         # the same check compiled for the CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _tpu_engine import greedy_tokens, write_llama

import tpuray.runtime as runtime
from tpuray.serve.llm.engine.embedded.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="tpu", choices=["tpu", "cpu"])
    ap.add_argument("--backend", default=None, help="compile backend (default: tpu on a TPU, else inductor)")
    ap.add_argument("--tokens", type=int, default=10)
    args = ap.parse_args()
    if args.device == "tpu":
        print(json.dumps({"runtime": runtime.activate()}))
        dims = dict(hidden=2048, layers=4, heads=32, kv_heads=8, inter=8192, vocab=32000)
    else:
        dims = dict(hidden=256, layers=2, heads=8, kv_heads=2, inter=512, vocab=1024)
    path = Path(tempfile.mkdtemp()) / "llama"
    write_llama(path, **dims)
    runner = ModelRunner(
        str(path), max_num_seqs=8, max_model_len=256, dtype="bfloat16", device=args.device,
        compile=True, compile_backend=args.backend,
    )  # fmt: skip
    runs = [(m, 0) for m in ("sync", "waited", "ahead", "sync")] + [("sync", 1)]
    first = None
    for mode, slot in runs:
        ids = greedy_tokens(runner, args.tokens, mode, slot)
        first = first or ids
        print(json.dumps({"mode": mode, "slot": slot, "tokens": ids, "same_as_first": ids == first}))


if __name__ == "__main__":
    main()
