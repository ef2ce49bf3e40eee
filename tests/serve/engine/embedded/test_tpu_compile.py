"""The engine's compile backends off a TPU: the donating backend needs torch_tpu and says so at
construction; the default backend per device (the on-chip checks are tests/real_tpu/test_engine.py)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from _util import stand_in_module
from tpuray.serve.llm.engine.embedded.runner import ModelRunner, default_backend
from tpuray.serve.llm.engine.embedded.tpu_compile import (
    TESTED_TORCH_TPU,
    aot_compilers,
    class_attribute_while,
    executables_not_copied,
    lookup,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_tpu") is not None,
    reason="torch_tpu is installed: the on-chip tests cover it",
)


def test_donating_backend_without_torch_tpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ImportError, match=r"compile_backend='tpu-donate' needs torch_tpu 0\.2\.0"):
        lookup("tpu-donate")
    with pytest.raises(
        ImportError, match="compile_backend='tpu-donate'"
    ):  # at construction, not the 1st step
        ModelRunner(
            tiny_model_dir, max_num_seqs=2, max_model_len=32, compile=True, compile_backend="tpu-donate"
        )


def test_default_backend_per_device():
    assert default_backend(torch.device("cpu"), 1) == "inductor"
    tpu = SimpleNamespace(type="tpu")  # the device's type is all it reads; no runtime activated here
    assert default_backend(tpu, 4) == "tpu"  # tensor parallel: programs with collectives
    assert lookup("eager") is not None  # any Dynamo backend name passes through


class _Artifact:
    """Stands in for torch_tpu's CompiledArtifact (the real one exists only with torch_tpu)."""

    def prepare_for_serialization(self) -> None:
        pass


class _Pending(_Artifact):
    """As torch_tpu's AsyncCompiledArtifact: any unknown attribute resolves the background compilation."""

    resolved = False

    def __getattr__(self, name):
        type(self).resolved = True
        raise AttributeError(name)


def _stand_in_torch_tpu(monkeypatch, version: str) -> None:
    stand_in_module(
        monkeypatch, "torch_tpu._internal.compile.torch_tpu_compiled_executable", CompiledArtifact=_Artifact
    )
    sys.modules["torch_tpu"].__version__ = version  # type: ignore[attr-defined]


def test_a_torch_tpu_executable_is_not_copied_to_be_saved(monkeypatch):
    """torch's own preparation for saving (`copy(result)`, then its `prepare_for_serialization`) keeps
    the executable itself inside executables_not_copied, without resolving a pending one; outside it,
    copies are copies again."""
    from torch._functorch._aot_autograd.aot_autograd_result import BundledOutputCodeLoadable

    _stand_in_torch_tpu(monkeypatch, TESTED_TORCH_TPU)
    pending = _Pending()
    entry = BundledOutputCodeLoadable(result=pending)
    with executables_not_copied():
        entry.pre_save()
    assert entry.result is pending and not _Pending.resolved
    assert copy.copy(pending) is not pending and "__copy__" not in _Artifact.__dict__


def test_another_torch_tpu_is_copied_as_before(monkeypatch):
    _stand_in_torch_tpu(monkeypatch, "0.3.0")
    artifact = _Artifact()
    with executables_not_copied():
        assert copy.copy(artifact) is not artifact


def test_an_attribute_set_by_another_entry_is_left_to_it():
    class Owner:
        pass

    mine = object()
    with class_attribute_while(Owner, "x", mine):
        with class_attribute_while(Owner, "x", object()):  # already set: left as it is
            assert Owner.x is mine
        assert Owner.x is mine
    assert "x" not in Owner.__dict__


class _InTheBackground:
    """A forward program as torch_tpu's AsyncCompiledArtifact hands it out: its class attributes are
    read without waiting; any other attribute waits for the background compilation (counted here)."""

    _boxed_call = True
    _fx_graph_cache_key = None
    _is_fallback = False
    waits = 0

    def __init__(self, graph):
        self.graph, self._boxed_call = graph, True  # as the executable it resolves to holds it

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        type(self).waits += 1
        raise AttributeError(name)

    def __call__(self, args):
        return self.graph(*args)


def test_a_program_compiled_in_the_background_is_not_waited_for_by_aot_autograd():
    from torch._dynamo.backends.common import aot_autograd

    def forward(graph, inputs):
        return _InTheBackground(graph)

    def backend(gm, example_inputs):
        return aot_autograd(**aot_compilers(_Artifact, forward, forward))(gm, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(lambda x: (x * 2 + 1).sum(), backend=backend, fullgraph=True)
    with torch.no_grad():
        assert step(torch.ones(4)).item() == 12.0
    assert _InTheBackground.waits == 0  # torch's disable() looked nothing up on it
