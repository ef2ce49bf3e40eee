"""The compiled programs of both engines kept on the host's disk, so that an engine started again (a second
start, or the replica Serve starts after an engine died) loads them instead of compiling them again.

    TPURAY_COMPILE_CACHE=/path/on/local/disk    # default ~/.cache/tpuray/compile; "off" turns it off

It is a directory per host (each host compiles for its own chips), shared by every engine started there:
- the embedded engine's whole step programs (`ProgramStore`, under `programs/`): Dynamo's captured graph
  and guards, AOTAutograd's wrappers and the backend's executable, saved with torch.compile's
  ahead-of-time API, so a second start neither traces, lowers nor compiles (XLA's cache below keeps only
  the last of the three: on the v5e, tracing and lowering were ~190 of a 224 s second start);
- torch_tpu's persistent compilation cache (its "tier 3": one XLA executable per program, keyed by the
  program and the compiler's version), under `torch_tpu/` (`TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`, with
  its in-memory tier 2, which tier 3 sits behind); vLLM's XLA programs go there, and the embedded
  engine's where it compiles them one by one (torch_tpu's background compilation, its default where
  it applies, writes none: its programs/ are then the only copy);
- vLLM's own cache (`VLLM_CACHE_ROOT`: its torch.compile artifacts, and vLLM-TorchTPU's per-range
  executables), under `vllm/`.
An entry that cannot be read or belongs to another compiler version is a miss for both caches (the program
is compiled again), never a failure. torch_tpu reads its setting once, at the first program it compiles in
a process: `enable()` runs before an engine's first compilation and sets these variables from
TPURAY_COMPILE_CACHE (the one setting; with "off" tpuray sets none of them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from tpuray.constants import COMPILE_CACHE_ENV

logger = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/tpuray/compile"
OFF = "off"
TORCH_TPU_ROOT_ENV = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
TORCH_TPU_TIER2_ENV = "TORCH_TPU_TIER2_COMPILATION_CACHE"
VLLM_CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"


def cache_dir() -> Path | None:
    """The host's cache directory (TPURAY_COMPILE_CACHE, default ~/.cache/tpuray/compile); None when off."""
    value = os.environ.get(COMPILE_CACHE_ENV, DEFAULT_DIR).strip()
    if value.lower() == OFF:
        return None
    if not value:
        raise ValueError(f"{COMPILE_CACHE_ENV} is empty; valid: a directory, or {OFF!r}")
    return Path(value).expanduser()


def enable(vllm: bool = False) -> Path | None:
    """Point torch_tpu's persistent cache (and, with `vllm`, vLLM's) at the host's cache directory, for
    this process and the processes it starts; returns the directory (None when off)."""
    root = cache_dir()
    if root is None:
        return None
    env = {TORCH_TPU_ROOT_ENV: str(root / "torch_tpu"), TORCH_TPU_TIER2_ENV: "tpuray"}
    if vllm:
        env[VLLM_CACHE_ROOT_ENV] = str(root / "vllm")
    for name, value in env.items():
        if name != TORCH_TPU_TIER2_ENV:
            Path(value).mkdir(parents=True, exist_ok=True)
        os.environ[name] = value
    logger.info("compilation cache: %s", {k: os.environ[k] for k in env})
    return root


def versions() -> dict[str, str]:
    """What a saved program was built with besides tpuray's own code: Python (the saved bytecode), torch
    and, where installed, torch_tpu and libtpu (the executable)."""
    found = {"python": platform.python_version()}
    for dist in ("torch", "torch_tpu", "libtpu", "tpuray"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def source_digest(package_dir: Path) -> str:
    """sha256 of the .py files under `package_dir` (their names and contents): the code a program traces."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        h.update(str(path.relative_to(package_dir)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class ProgramStore:
    """Whole compiled programs, one file per program name, in a directory of their own key: everything a
    program depends on except the weights' values (which stay inputs of the program). `for_key` returns
    None when the cache is off. An entry that cannot be read (corrupt, another version's) is a miss,
    logged; a program that cannot be saved is logged once and kept in memory only. The directory is made
    at the first save; a key's directory is marked used at every start (its key.json), and the first save
    under a new key removes all but the KEEP_KEYS most recently used ones (a 1.1B model's programs take
    ~550 MB; any new tpuray, torch or torch_tpu version, or a new model shape, is a new key)."""

    KEEP_KEYS = 3

    def __init__(self, directory: Path, key_text: str):
        self.directory = directory
        self._key_text = key_text
        self._save_failed = False
        if (directory / "key.json").exists():
            os.utime(directory / "key.json")  # used now: kept by the next clean-up

    @classmethod
    def for_key(cls, key: Mapping[str, Any]) -> ProgramStore | None:
        root = cache_dir()
        if root is None:
            return None
        text = json.dumps({**key, "versions": versions()}, sort_keys=True, default=str, indent=1)
        return cls(root / "programs" / hashlib.sha256(text.encode()).hexdigest()[:24], text)

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    def load(self, name: str) -> Any | None:
        """The saved program `name` (torch's AOTCompiledFunction), or None when there is none usable."""
        import torch

        path = self.path(name)
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f)
        except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss: compiled again
            logger.warning(
                "compilation cache: %s unreadable (%s: %s); compiling it again", path, type(e).__name__, e
            )
            return None

    def save(self, name: str, program: Any) -> None:
        if self._save_failed:
            return
        try:
            if not self.directory.exists():
                self.directory.mkdir(parents=True)
                (self.directory / "key.json").write_text(self._key_text)
                self._remove_old_keys()
            program.save_compiled_function(str(self.path(name)))
        except Exception as e:  # noqa: BLE001 - serving goes on with the program in memory
            self._save_failed = True
            logger.warning(
                "compilation cache: programs of %s cannot be saved (%s: %s); a next start compiles them again",
                self.directory,
                type(e).__name__,
                e,
            )

    def _remove_old_keys(self) -> None:
        def used(d: Path) -> float:
            marker = d / "key.json"
            return marker.stat().st_mtime if marker.exists() else d.stat().st_mtime

        keys = sorted((d for d in self.directory.parent.iterdir() if d.is_dir()), key=used, reverse=True)
        for old in keys[self.KEEP_KEYS :]:
            logger.info("compilation cache: removing programs no start used lately: %s", old)
            shutil.rmtree(old, ignore_errors=True)
