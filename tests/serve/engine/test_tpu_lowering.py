"""torch_tpu's MLIR tracebacks switched off where tpuray's engines lower graphs (tpu_lowering.py): the
switch's stack is balanced, and nothing is switched without torch_tpu or where TORCH_TRACE keeps them."""

from __future__ import annotations

import importlib.util
import threading
from types import SimpleNamespace

import pytest

from tpuray.constants import TORCH_TRACE_ENV
from tpuray.serve.llm.engine.tpu_lowering import tracebacks_off_in_this_thread, without_tracebacks

no_torch_tpu = pytest.mark.skipif(
    importlib.util.find_spec("torch_tpu") is not None,
    reason="torch_tpu is installed: tests/real_tpu cover it",
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


@no_torch_tpu
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
