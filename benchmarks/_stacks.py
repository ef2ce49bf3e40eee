"""Where a run's Python time goes, sampled from inside the process (no ptrace, which a VM may refuse).

`Sampler(path)` samples every thread's stack about every `interval_s` until `stop()`, then writes a header
("# wall_s W rounds R interval_s I busy_s B") and one line per distinct stack: "thread;file:function:line;...;leaf
seconds" (root first, flame-graph "collapsed" form, weighted by time). Each round's stacks are weighted by
the seconds since the previous round: the sampler needs the GIL, so a C++ call that holds it (torch_tpu's
lowering may) delays the next round, which then sees the thread just after that call, in the Python
function that made it (so its time lands there, one line later). Rounds much fewer than wall_s /
interval_s mean the GIL was held that long. busy_s is the sampler's own time in its rounds, the GIL
held by it: about what it took from the run.

Read one: `python3 benchmarks/_stacks.py PATH [N [THREAD]]`: the N functions with the most seconds on
their own (self) and anywhere on the stack (inclusive), for the threads whose name starts with THREAD
(default MainThread).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path
from types import CodeType


class Sampler:
    """Samples every thread's Python stack in a daemon thread; `stop()` writes what it counted."""

    def __init__(self, path: str | Path, interval_s: float = 0.02):
        self.path, self.interval_s = Path(path), interval_s
        self.seconds: collections.Counter[str] = collections.Counter()
        self.rounds = 0
        self.busy_s = 0.0  # the sampler's own time in its rounds (it holds the GIL meanwhile)
        self._names: dict[CodeType, str] = {}
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="stack-sampler", daemon=True)
        self._thread.start()

    def _name(self, code: CodeType) -> str:
        name = self._names.get(code)
        if name is None:
            name = self._names[code] = f"{os.path.basename(code.co_filename)}:{code.co_name}"
        return name

    def _loop(self) -> None:
        me, last = threading.get_ident(), time.perf_counter()
        while not self._done.wait(self.interval_s):
            now = time.perf_counter()
            weight, last = now - last, now
            self.rounds += 1
            self._round(me, weight)
            self.busy_s += time.perf_counter() - now

    def _round(self, me: int, weight: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack = []
            while frame is not None:
                stack.append(f"{self._name(frame.f_code)}:{frame.f_lineno}")
                frame = frame.f_back
            self.seconds[";".join([names.get(ident, str(ident)), *reversed(stack)])] += weight

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        wall = time.perf_counter() - self._start
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            f"# wall_s {wall:.2f} rounds {self.rounds} interval_s {self.interval_s} busy_s {self.busy_s:.2f}"
        ]
        lines += [f"{stack} {s:.4f}" for stack, s in self.seconds.most_common()]
        self.path.write_text("\n".join(lines) + "\n")


def top(path: str | Path, n: int = 25, thread: str = "MainThread") -> str:
    """The `n` functions (file:function, lines merged) with the most seconds, self and inclusive."""
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    header, total = "", 0.0
    for line in Path(path).read_text().splitlines():
        if line.startswith("#"):
            header = line.lstrip("# ")
            continue
        stack, seconds = line.rsplit(" ", 1)
        name, *frames = stack.split(";")
        if not name.startswith(thread) or not frames:
            continue
        s = float(seconds)
        total += s
        funcs = [f.rsplit(":", 1)[0] for f in frames]
        own[funcs[-1]] += s
        for f in set(funcs):
            anywhere[f] += s
    out = [f"{header}; {total:.1f} s sampled in threads {thread}*"]
    for title, counter in (("self", own), ("inclusive", anywhere)):
        out.append(f"-- {title}")
        out += [f"{s:8.1f} s {100 * s / max(total, 1e-9):5.1f}%  {f}" for f, s in counter.most_common(n)]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    if not argv or len(argv) > 3 or (len(argv) > 1 and not argv[1].isdigit()):
        sys.exit(f"usage: python3 benchmarks/_stacks.py PATH [N [THREAD]]  (N: a count; got {argv[1:]})")
    print(top(argv[0], int(argv[1]) if len(argv) > 1 else 25, argv[2] if len(argv) > 2 else "MainThread"))


if __name__ == "__main__":
    main(sys.argv[1:])
