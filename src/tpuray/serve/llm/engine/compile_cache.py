"""The compiled programs of both engines kept on the host's disk, so that an engine started again (a second
start, or the replica Serve starts after an engine died) loads them instead of compiling them again.

    TPURAY_COMPILE_CACHE=/path/on/local/disk    # default ~/.cache/tpuray/compile; "off" turns it off

It is a directory per host (each host compiles for its own chips), shared by every engine started there:
- torch_tpu's persistent compilation cache (its "tier 3": one XLA executable per program, keyed by the
  program and the compiler's version), under `torch_tpu/` (`TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`, with
  its in-memory tier 2, which tier 3 sits behind); both engines' XLA programs go there;
- vLLM's own cache (`VLLM_CACHE_ROOT`: its torch.compile artifacts, and vLLM-TorchTPU's per-range
  executables), under `vllm/`.
An entry that cannot be read or belongs to another compiler version is a miss for both caches (the program
is compiled again), never a failure. torch_tpu reads its setting once, at the first program it compiles in
a process: `enable()` runs before an engine's first compilation and sets these variables from
TPURAY_COMPILE_CACHE (the one setting; with "off" tpuray sets none of them).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

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
