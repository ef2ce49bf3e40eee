"""Compiled programs read without copies or stacks (tpu_programs.py): torch_tpu's executables shared
inside executables_not_copied (a stand-in torch_tpu here: the real one exists only on a TPU VM), fake
modes without their stacks, and the class attribute switch both rest on."""

from __future__ import annotations

import copy
import sys

from torch._inductor.output_code import OutputCode

from _util import WITHOUT_TORCH_TPU, stand_in_module
from tpuray.serve.llm.engine.tpu_programs import (
    TESTED_TORCH_TPU,
    backend_code_shared,
    class_attribute_while,
    executables_not_copied,
    fake_modes_without_stacks,
    programs_loaded_lightly,
)


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


@WITHOUT_TORCH_TPU
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


@WITHOUT_TORCH_TPU
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


@WITHOUT_TORCH_TPU
def test_a_deep_copy_shares_the_executable_as_torch_s_loader_makes_one(monkeypatch):
    """torch's loader deep-copies a loaded program's cache entry; inside executables_not_copied the
    entry is copied and the executable in it shared, without resolving a pending one."""
    _stand_in_torch_tpu(monkeypatch, TESTED_TORCH_TPU)
    pending = _Pending()
    entry = {"graphs": [{"result": pending}], "guards": [1, 2]}
    with programs_loaded_lightly():
        copied = copy.deepcopy(entry)
    assert copied is not entry and copied["guards"] is not entry["guards"]
    assert copied["graphs"][0]["result"] is pending and not _Pending.resolved
    assert copy.deepcopy(pending) is not pending and "__deepcopy__" not in _Artifact.__dict__


def test_fake_modes_record_no_stack_while_programs_load():
    from torch._subclasses import FakeTensorMode, fake_tensor

    original = fake_tensor.traceback
    with fake_modes_without_stacks():
        with fake_modes_without_stacks():  # nested: the outer entry's switch stays
            assert len(FakeTensorMode()._stack_trace) == 0
        assert len(FakeTensorMode()._stack_trace) == 0
        assert FakeTensorMode().stack == ""
    assert fake_tensor.traceback is original and len(FakeTensorMode()._stack_trace) > 0


class _Code(OutputCode):
    """A backend's compiled code, as torch_tpu's executables and Inductor's graphs are (OutputCode)."""

    def __init__(self) -> None:
        self.payload = [1, 2, 3]


def test_a_loaded_programs_backend_code_is_shared_not_copied():
    code = _Code()
    with backend_code_shared():
        assert copy.deepcopy({"result": code})["result"] is code
    copied = copy.deepcopy({"result": code})["result"]
    assert copied is not code and copied.payload == code.payload  # outside it, deep copies as before
