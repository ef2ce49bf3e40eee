"""torch_tpu's MLIR tracebacks, off where tpuray's engines lower their graphs on a real TPU.

torch_tpu records, for every op of a graph it lowers, the Python traceback that made it (MLIR locations,
for its error messages). On the v5e (`bench_real_tpu.py scan-probe --dims 1b-hd128`) a step program's
first call took 0.50-0.55x the time without them, its step time 0.97-1.01x. So tpuray's engines lower
without them: the embedded engine around each program's lowering (embedded/tpu_compile.py), vLLM-TorchTPU
in the thread that runs vLLM's engine core in process (vllm/inprocess.py) and while a colocated vLLM
starts (rl/rollout/vllm_colocated.py). Where TORCH_TRACE asks for torch_tpu's trace, they are kept.
torch_tpu keeps the switch in a stack per thread (with its other context states).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from tpuray.constants import TORCH_TRACE_ENV

logger = logging.getLogger(__name__)


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


def _switch_off() -> Any | None:
    """torch_tpu's switch, pushed off in this thread; None when kept, or without torch_tpu or its switch
    (a CPU, an emulated slice, another torch_tpu): never an error, the tracebacks then stay."""
    if tracebacks_kept():
        return None
    try:
        from torch_tpu._internal.compile import tpu_torch_compile as state
    except ImportError:
        return None
    try:
        state.push_enable_tracebacks(False)
    except Exception as e:  # noqa: BLE001 - another torch_tpu: lowering keeps its tracebacks, slower
        logger.warning("torch_tpu's MLIR tracebacks stay on (%s: %s)", type(e).__name__, e)
        return None
    return state


def tracebacks_off_in_this_thread() -> bool:
    """Tracebacks off for the rest of this thread's life (a thread that lowers for one engine only);
    True where switched off. Never raises, so that a thread pool's initializer may call it."""
    return _switch_off() is not None


@contextlib.contextmanager
def tracebacks_off() -> Iterator[None]:
    """Tracebacks off in this thread while it lasts (where `_switch_off` can switch them)."""
    state = _switch_off()
    try:
        yield
    finally:
        if state is not None:
            state.pop_enable_tracebacks()
