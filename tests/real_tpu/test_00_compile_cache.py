"""The engines' persistent compilation cache on the real chip (tpuray.serve.llm.engine.compile_cache):
a program compiled in one process is kept on disk under TPURAY_COMPILE_CACHE, and a process that finds
every kept entry corrupt still compiles and gives the same result (first in the suite: child processes
open the chip only while this process does not hold it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = """
import torch
from tpuray.serve.llm.engine import compile_cache
print("CACHE", compile_cache.enable())
f = torch.compile(lambda x: (x @ x).relu().sum(0), backend="tpu", dynamic=False, fullgraph=True)
x = (torch.arange(64.0).reshape(8, 8) / 64).to("tpu")
print("RESULT", [round(v, 4) for v in f(x).cpu().tolist()])
"""


def _run(cache: Path) -> str:
    env = dict(os.environ, TPURAY_COMPILE_CACHE=str(cache))
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and "RESULT" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
    return out.stdout.split("RESULT", 1)[1].strip()


def test_a_program_is_kept_on_disk_and_a_corrupt_entry_is_compiled_again(tmp_path):
    cache = tmp_path / "compile-cache"
    first = _run(cache)
    kept = [p for p in (cache / "torch_tpu").rglob("*") if p.is_file()]
    print(f"kept: {[(str(p.relative_to(cache)), p.stat().st_size) for p in kept]}")
    assert kept, "torch_tpu kept nothing under TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
    for p in kept:  # every entry unreadable: a miss, compiled again, never a failure
        p.write_bytes(b"not an executable" * 8)
    assert _run(cache) == first


def test_a_second_start_loads_the_engines_programs_whole(tmp_path):
    """The embedded runner's step programs (embedded/programs.py, backend "tpu-donate"): the first start
    compiles and saves them, the second loads every one (no tracing, no compiling) and gives the same
    greedy tokens."""
    from _util import runner_start

    model = str(tmp_path / "model")  # built by the first start's process (this one must not open the chip)
    cache = tmp_path / "compile-cache"
    first = runner_start(model, cache, "tpu", "tpu-donate")
    assert first["compiled"] == first["programs"] and first["loaded"] == 0
    second = runner_start(model, cache, "tpu", "tpu-donate", load_workers=4)  # read by 4 threads
    print(
        f"second start: {second['loaded']} loaded, {second['compiled']} compiled; tokens {second['tokens']}"
    )
    assert second["compiled"] == 0 and second["loaded"] == second["programs"]
    assert second["tokens"] == first["tokens"]


def test_programs_compiled_in_the_background_give_the_same_tokens(tmp_path):
    """async_compile (torch_tpu lowers and compiles in its threads while the next program is traced):
    every program built and saved, the same greedy tokens as compiled one by one, loaded again whole."""
    from _util import runner_start

    model = str(tmp_path / "model")
    first = runner_start(model, tmp_path / "cache-sync", "tpu", "tpu-donate")
    background = runner_start(model, tmp_path / "cache-async", "tpu", "tpu-donate", async_compile=True)
    assert background["compiled"] == background["programs"] and background["tokens"] == first["tokens"]
    again = runner_start(model, tmp_path / "cache-async", "tpu", "tpu-donate")
    assert again["loaded"] == again["programs"] and again["tokens"] == first["tokens"]
