"""torch_tpu's MLIR tracebacks switched off where tpuray's engines lower graphs (tpu_lowering.py): the
switch's stack is balanced, and nothing is switched without torch_tpu or where TORCH_TRACE keeps them."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from _util import WITHOUT_TORCH_TPU, stand_in_module
from tpuray.constants import TORCH_TRACE_ENV
from tpuray.serve.llm.engine.tpu_lowering import (
    tracebacks_off,
    tracebacks_off_in_this_thread,
    without_tracebacks,
)


def test_lowering_runs_with_tracebacks_off_and_restores_them_after_an_error():
    """A lowering pushes torch_tpu's "tracebacks off" state around each graph, in the
    thread that lowers it, and pops it even when the lowering fails (a stand-in for torch_tpu's state
    stack: the real one exists only with torch_tpu)."""
    stack: list[bool] = []
    state = SimpleNamespace(push_enable_tracebacks=stack.append, pop_enable_tracebacks=stack.pop)
    seen = []

    def lower(graph):
        seen.append(list(stack))
        if graph == "bad":
            raise RuntimeError("lowering failed")
        return graph

    quiet = without_tracebacks(lower, state)
    assert quiet("g") == "g" and seen == [[False]] and stack == []
    with pytest.raises(RuntimeError, match="lowering failed"):
        quiet("bad")
    assert stack == []


@WITHOUT_TORCH_TPU
def test_a_thread_without_torch_tpu_is_left_as_it_is(monkeypatch):
    monkeypatch.delenv(TORCH_TRACE_ENV, raising=False)
    switched: list[bool] = []
    thread = threading.Thread(target=lambda: switched.append(tracebacks_off_in_this_thread()))
    thread.start()
    thread.join()
    assert switched == [False]


def test_torch_trace_keeps_the_tracebacks(monkeypatch):
    monkeypatch.setenv(TORCH_TRACE_ENV, "/tmp/trace")
    assert tracebacks_off_in_this_thread() is False


def _stand_in_torch_tpu(monkeypatch, push) -> list[bool]:
    """torch_tpu's switch module as a stand-in (the real one exists only with torch_tpu); returns its stack."""
    stack: list[bool] = []
    stand_in_module(
        monkeypatch,
        "torch_tpu._internal.compile.tpu_torch_compile",
        push_enable_tracebacks=push or stack.append,
        pop_enable_tracebacks=stack.pop,
    )
    monkeypatch.delenv(TORCH_TRACE_ENV, raising=False)
    return stack


def test_a_switch_that_fails_leaves_the_pool_working(monkeypatch, caplog):
    """Another torch_tpu whose switch raises: the tracebacks stay, with a warning, and the engine core's
    thread pool (whose initializer this is) still runs its work."""

    def push(_):
        raise TypeError("push_enable_tracebacks() takes no arguments")

    _stand_in_torch_tpu(monkeypatch, push)
    with ThreadPoolExecutor(1, initializer=tracebacks_off_in_this_thread) as pool:
        assert pool.submit(lambda: 42).result() == 42
    assert "MLIR tracebacks stay on (TypeError" in caplog.text


def test_the_context_switches_them_off_and_back(monkeypatch):
    stack = _stand_in_torch_tpu(monkeypatch, None)
    with tracebacks_off():
        assert stack == [False]
    assert stack == []
    with pytest.raises(RuntimeError), tracebacks_off():
        raise RuntimeError("lowering failed")
    assert stack == []
