"""Compiled programs read from torch's caches without copies or stacks nobody reads: what both engines'
starts wrap around torch's loaders (the embedded engine's program store, vLLM-TorchTPU's compile cache).

- `executables_not_copied`: a copy or deep copy of a torch_tpu executable is the executable itself.
  torch copies a program's cache entry to save it (`copy(result)`) and deep-copies a loaded entry "in
  case it needs to be serialized again"; for a torch_tpu executable each copy serializes the executable
  and loads it onto the chip again, held as long as the program. Sampled on the v5e: 6.5 s of
  vLLM-TorchTPU's 81 s second start, 13.1 s of saving at the embedded engine's first start (3.2-4.9 s since).
- `fake_modes_without_stacks`: a FakeTensorMode made meanwhile records no stack of its making. torch's
  guard loader makes one per tensor it unpickles, each taking `traceback.extract_stack()` (a stat of
  every source file on the stack): 2.7 s of the embedded engine's 27.6 s second start on the v5e. Only
  debugging messages read that stack (`FakeTensorMode.stack`, then empty).

Both are process-wide while they last, as torch_tpu's own asynchronous saves are: enter them around an
engine's start, where nothing else copies programs. (`backend_code_shared`, the embedded engine's, shares
any backend's code, not torch_tpu's only.)
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from importlib import metadata
from typing import Any

TESTED_TORCH_TPU = "0.2.0"
"""The torch_tpu whose internals tpuray's engines were written and checked against."""


def torch_tpu_version() -> str | None:
    """The installed torch_tpu's version; None without one."""
    try:
        return metadata.version("torch_tpu")
    except metadata.PackageNotFoundError:  # imported from a path, not installed
        return getattr(sys.modules.get("torch_tpu"), "__version__", None)


@contextlib.contextmanager
def class_attribute_while(cls: type, name: str, value: Any) -> Iterator[None]:
    """`cls.name = value` while it lasts, where `cls` defines no `name` of its own; removed at the end by
    the entry that set it (an entry that finds it set, by another thread meanwhile, leaves it alone)."""
    if name in cls.__dict__:
        yield
        return
    setattr(cls, name, value)
    try:
        yield
    finally:
        if cls.__dict__.get(name) is value:
            delattr(cls, name)


@contextlib.contextmanager
def executables_not_copied() -> Iterator[None]:
    """While it lasts, a copy or deep copy of a torch_tpu executable (of TESTED_TORCH_TPU, whose
    `prepare_for_serialization` and `post_compile` do nothing) is the executable itself. Nothing where
    torch_tpu is absent, another version (whose preparing might do something) or defines its own."""
    try:
        from torch_tpu._internal.compile.torch_tpu_compiled_executable import CompiledArtifact
    except ImportError:
        yield
        return
    if torch_tpu_version() != TESTED_TORCH_TPU:
        yield
        return
    with (
        class_attribute_while(CompiledArtifact, "__copy__", _itself),
        class_attribute_while(CompiledArtifact, "__deepcopy__", _itself),
    ):
        yield


def _itself(self: Any, memo: Any = None) -> Any:
    return self


@contextlib.contextmanager
def backend_code_shared() -> Iterator[None]:
    """While it lasts, a deep copy of any backend's compiled code (torch's `OutputCode`: torch_tpu's
    executables, Inductor's graphs) is the object itself: the embedded engine's own loads, whose
    programs are never saved again (vLLM's starts share torch_tpu's executables only, as vLLM may save
    what it loaded: `executables_not_copied`)."""
    from torch._inductor.output_code import OutputCode

    with class_attribute_while(OutputCode, "__deepcopy__", _itself):  # unless torch's own
        yield


class _WithoutStacks:
    """The traceback module as torch's fake_tensor module uses it, with no stack extracted."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @staticmethod
    def extract_stack(f: Any = None, limit: int | None = None) -> traceback.StackSummary:
        return traceback.StackSummary()


@contextlib.contextmanager
def fake_modes_without_stacks() -> Iterator[None]:
    """While it lasts, a FakeTensorMode made (in any thread) records no stack of its making."""
    from torch._subclasses import fake_tensor

    original = fake_tensor.traceback
    if isinstance(original, _WithoutStacks):  # an outer entry's: left to it
        yield
        return
    ours = _WithoutStacks(original)
    fake_tensor.traceback = ours  # type: ignore[assignment]
    try:
        yield
    finally:
        if fake_tensor.traceback is ours:
            fake_tensor.traceback = original


@contextlib.contextmanager
def programs_loaded_lightly() -> Iterator[None]:
    """Both: executables shared, fake modes without stacks (an engine's start)."""
    with executables_not_copied(), fake_modes_without_stacks():
        yield
