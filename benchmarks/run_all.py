"""Run every benchmark in this folder, one after another, and tee the output to benchmarks/latest.txt.

    .venv/bin/python benchmarks/run_all.py            # all
    .venv/bin/python benchmarks/run_all.py topology   # only bench_topology.py
Each script runs ours side by side with its anchor and prints its own table; see benchmarks/README.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = [
    "topology", "bookkeeping", "slices", "collectives", "device", "train", "checkpoint", "serve", "serve_vs_ray", "sampling", "preemption", "serve_recovery", "rl", "autoscale", "idle_cluster",
]  # fmt: skip
# options a script runs with here; the rest by hand (its docstring): the loaded recovery cases take ~1 h
ARGS = {"serve_recovery": ["--load", "0"]}


def main(argv: list[str]) -> int:
    names = argv or ORDER
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; valid: {', '.join(ORDER)}", file=sys.stderr)
        return 2
    out = HERE / "latest.txt"
    failed = []
    with out.open("w") as log:
        log.write(f"# cores: {os.cpu_count()}\n")
        for name in names:
            script = HERE / f"bench_{name}.py"
            header = f"\n=== {script.name} ===\n"
            print(header, end="", flush=True)
            log.write(header)
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, str(script), *ARGS.get(name, [])], capture_output=True, text=True
            )
            text = proc.stdout + (proc.stderr[-2000:] if proc.returncode else "")
            print(text, flush=True)
            log.write(text + f"\n({time.perf_counter() - t0:.0f} s, exit {proc.returncode})\n")
            if proc.returncode:
                failed.append(name)
    print(f"\nwrote {out}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
