"""The engine's compile backends off a TPU: the donating backend needs torch_tpu and says so at
construction; the default backend per device (the on-chip checks are tests/real_tpu/test_engine.py)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tpuray.serve.llm.engine.embedded.runner import ModelRunner, default_backend
from tpuray.serve.llm.engine.embedded.tpu_compile import executables_not_copied, lookup

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


def test_a_torch_tpu_executable_is_not_copied_to_be_saved(monkeypatch):
    """AOTAutograd readies a program for saving with `copy(result)`: inside executables_not_copied a
    torch_tpu executable (a stand-in class here: the real one exists only with torch_tpu) is its own
    copy, subclasses too; outside it, copies are copies again."""

    class CompiledArtifact:
        payload = [1, 2]

    class Executable(CompiledArtifact):
        pass

    names = ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.compile")
    for name in names:
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    module = ModuleType("torch_tpu._internal.compile.torch_tpu_compiled_executable")
    module.CompiledArtifact = CompiledArtifact  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    executable = Executable()
    with executables_not_copied():
        assert copy.copy(executable) is executable
    assert copy.copy(executable) is not executable and "__copy__" not in CompiledArtifact.__dict__
