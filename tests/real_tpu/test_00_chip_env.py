"""tpuray's per-chip environment opens the real chip (first in the suite: a child process can open the
chip only while this process does not hold it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tpuray.topology import SliceTopology
from tpuray.topology.env import worker_env

OPEN_CHIP = "import torch; x = torch.ones(4, device='tpu') * 2; print('SUM', float(x.sum().cpu()))"


def _tcp_works() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
        return True
    except OSError:
        return False


def _run_with(env_update: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_update)
    return subprocess.run(
        [sys.executable, "-c", OPEN_CHIP], env=env, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.parametrize("topology", ["1x1", "2x2"])
def test_tpuray_env_of_chip_0_opens_the_chip(topology):
    """Chip 0 of a v5e host as one process of its own: the env tpuray computes (libtpu's process
    bounds/addresses, TorchTPU's slice-builder variables) for a 1x1 slice and for chip 0 of a 2x2 host."""
    env = worker_env(SliceTopology.parse("TPU-V5E", topology), 0)
    if int(env["TORCH_TPU_DEVICES_PER_HOST"]) > 1 and not _tcp_works():
        pytest.skip(
            "chip 0 of a 4-process host: libtpu builds its compilation context over TCP between the "
            "host's processes, and this machine has no TCP sockets (a one-chip test VM)"
        )
    out = _run_with(env, timeout_s=90)
    assert out.returncode == 0 and "SUM 8.0" in out.stdout, (env, out.stdout[-2000:], out.stderr[-4000:])
