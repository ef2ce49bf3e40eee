"""torch_tpu's MLIR tracebacks, off where tpuray's engines lower their graphs on a real TPU.

torch_tpu records, for every op of a graph it lowers, the Python traceback that made it (MLIR locations,
for its error messages). On the v5e (`bench_real_tpu.py scan-probe --dims 1b-hd128`) a step program's
first call took 0.50-0.55x the time without them, its step time 0.97-1.01x. So tpuray's engines lower
without them: the embedded engine around each program's lowering (embedded/tpu_compile.py), vLLM-TorchTPU
in the thread that runs vLLM's engine core in process (vllm/inprocess.py), where all its graphs are
lowered. Where TORCH_TRACE asks for torch_tpu's trace, they are kept. torch_tpu keeps the switch as a
stack per thread.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from tpuray.constants import TORCH_TRACE_ENV


def tracebacks_kept() -> bool:
    """Whether lowering keeps its tracebacks anyway: TORCH_TRACE is set."""
    return bool(os.environ.get(TORCH_TRACE_ENV))


def without_tracebacks(lower: Callable[..., Any], state: Any) -> Callable[..., Any]:
    """`lower` (a lowering of one graph) with tracebacks off in the thread that runs it; `state` is
    torch_tpu's switch (`tpu_torch_compile`: push_enable_tracebacks / pop_enable_tracebacks)."""

    @functools.wraps(lower)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        state.push_enable_tracebacks(False)
        try:
            return lower(*args, **kwargs)
        finally:
            state.pop_enable_tracebacks()

    return quiet


def tracebacks_off_in_this_thread() -> bool:
    """Tracebacks off for the rest of this thread's life (a thread that lowers for one engine only), unless
    kept; True where switched off, False when kept or without torch_tpu's switch (a CPU, an emulated
    slice, a torch_tpu without it): never an error, so that a thread pool's initializer may call it."""
    if tracebacks_kept():
        return False
    try:
        from torch_tpu._internal.compile import tpu_torch_compile
    except ImportError:
        return False
    push = getattr(tpu_torch_compile, "push_enable_tracebacks", None)
    if push is None:
        return False
    push(False)
    return True
