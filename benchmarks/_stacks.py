"""Where a run's Python time goes, sampled from inside the process (no ptrace, which a VM may refuse).

`Sampler(path)` samples every thread's stack each `interval_s` until `stop()`, then writes one line per
distinct stack: "thread;file:function:line;...;leaf count" (root first, flame-graph "collapsed" form). A
frame inside C++ (torch_tpu's lowering, libtpu's compiler) shows as the Python call that entered it.

Read one: `python3 benchmarks/_stacks.py PATH [N] [THREAD]`: the N functions with the most samples on
their own (self) and anywhere on the stack (inclusive), for the threads whose name starts with THREAD
(default MainThread).
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path


class Sampler:
    """Samples every thread's Python stack in a daemon thread; `stop()` writes what it counted."""

    def __init__(self, path: str | Path, interval_s: float = 0.02):
        self.path, self.interval_s = Path(path), interval_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stack-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        me = threading.get_ident()
        while not self._done.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                self.counts[";".join([names.get(ident, str(ident)), *reversed(stack)])] += 1

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"{stack} {n}" for stack, n in self.counts.most_common()]
        self.path.write_text("\n".join(lines) + "\n")


def top(path: str | Path, n: int = 25, thread: str = "MainThread") -> str:
    """The `n` functions (file:function, lines merged) with the most samples, self and inclusive."""
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        name, *frames = stack.split(";")
        if not name.startswith(thread) or not frames:
            continue
        k = int(count)
        total += k
        funcs = [f.rsplit(":", 1)[0] for f in frames]
        own[funcs[-1]] += k
        for f in set(funcs):
            anywhere[f] += k
    out = [f"{total} samples of {thread!r}"]
    for title, counter in (("self", own), ("inclusive", anywhere)):
        out.append(f"-- {title}")
        out += [f"{100 * c / max(total, 1):5.1f}%  {f}" for f, c in counter.most_common(n)]
    return "\n".join(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    print(top(args[0], int(args[1]) if len(args) > 1 else 25, args[2] if len(args) > 2 else "MainThread"))
