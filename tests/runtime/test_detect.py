"""Choosing between a real TorchTPU and the emulation when the torch_tpu package is installed.

torch_tpu cannot run here (no TPU chips), so these tests put a stand-in `torch_tpu` package on the path:
it imports and, like the real one on a machine without chips, registers no `tpu_dist`. (With the real
torch_tpu 0.2.0 on this CPU machine the same paths were checked by hand, see docs/real-tpu.md.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _util import free_port
from conftest import run_python
from tpuray.constants import TPU_HOST_TRANSFER_ENV
from tpuray.runtime import detect

CHECK = """
import json, sys
import torch, torch.distributed as dist
import tpuray.runtime as rt
from tpuray.runtime import detect
r = {
    "installed": detect.torch_tpu_installed(),
    "usable": detect.torch_tpu_usable(),
    "emulated": rt.is_emulated(),
    "privateuse1": torch._C._get_privateuse1_backend_name(),
}
try:
    dist.init_process_group("tpu_dist", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
    r["dist"] = "initialised"
except (RuntimeError, AssertionError) as e:  # AssertionError: torch's "Unknown backend type"
    r["dist"] = str(e)
if not r["usable"]:
    import torch_tpu  # what the real package's torch.backends entry point does at `import torch`
    try:
        rt.activate()
        r["activate"] = "no error"
    except RuntimeError as e:
        r["activate"] = str(e)
print(json.dumps(r))
"""


@pytest.fixture
def stand_in(tmp_path) -> dict[str, str]:
    pkg = tmp_path / "torch_tpu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Stand-in for torch_tpu on a machine without TPU chips."""\n')
    return {"PYTHONPATH": str(tmp_path)}


def _run(extra_env: dict[str, str]) -> tuple[dict, str]:
    proc = run_python(CHECK % free_port(), extra_env=extra_env)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_installed_but_unusable_torch_tpu_blocks_emulation_with_an_explanation(stand_in) -> None:
    r, stderr = _run(stand_in)
    assert r["installed"] and not r["usable"]  # probed in a subprocess: no tpu_dist registered
    assert not r["emulated"] and r["privateuse1"] == "privateuseone"  # PrivateUse1 left alone
    assert "NOT emulated" in stderr and "pip uninstall torch_tpu" in stderr  # logged at import torch
    for msg in (r["dist"], r["activate"]):
        assert "torch_tpu is installed" in msg and "no TPU chip is usable" in msg


def test_probe_answer_is_inherited_from_the_parent(stand_in) -> None:
    """TPURAY_TORCH_TPU_USABLE (set by the emulator on its hosts) is trusted instead of probing again."""
    r, stderr = _run({**stand_in, "TPURAY_TORCH_TPU_USABLE": "1"})
    assert r["installed"] and r["usable"]  # no probe: the stand-in would have failed it
    assert not r["emulated"] and "NOT emulated" not in stderr  # stands aside for the "real" TorchTPU
    assert "Unknown backend type tpu_dist" in r["dist"]  # left to torch_tpu (this stand-in has none)
    r, _ = _run({**stand_in, "TPURAY_TORCH_TPU_USABLE": "0"})
    assert not r["usable"] and "torch_tpu is installed" in r["dist"]


HOST_ENV = """
import json
from tpuray.emulator.hosts import _torch_tpu_env
from tpuray.runtime import detect
print(json.dumps({"env": _torch_tpu_env(), "shim": str(detect.SHIM_DIR)}))
"""


def test_emulated_torch_tpu_never_shadows_a_real_one(stand_in) -> None:
    """Emulated hosts get tpuray's emulated torch_tpu on PYTHONPATH only where no real one is installed."""
    without = json.loads(run_python(HOST_ENV, emulation=False).stdout.strip().splitlines()[-1])
    assert without["env"]["PYTHONPATH"].split(":")[0] == without["shim"]
    with_real = json.loads(
        run_python(HOST_ENV, emulation=False, extra_env=stand_in).stdout.strip().splitlines()[-1]
    )
    assert "PYTHONPATH" not in with_real["env"] and with_real["env"]["TPURAY_TORCH_TPU_USABLE"] == "0"


def test_the_emulated_torch_tpu_is_not_taken_for_a_real_one() -> None:
    from tpuray.runtime import detect

    r, _ = _run({"PYTHONPATH": str(detect.SHIM_DIR)})
    assert not r["installed"] and not r["usable"] and r["emulated"] and r["dist"] == "initialised"


@pytest.mark.parametrize("size", [None, "", "0", "4G", "-1"])
def test_a_real_tpu_without_the_premapped_buffer_is_told_what_to_set(size):
    environ = {} if size is None else {"TPU_PREMAPPED_BUFFER_SIZE": size}
    hint = detect.host_transfer_hint(environ)
    assert hint is not None
    assert "TPU_PREMAPPED_BUFFER_SIZE=4294967296" in hint
    assert "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES=4294967296" in hint
    assert detect.host_transfer_hint({"TPU_PREMAPPED_BUFFER_SIZE": "4294967296"}) is None


def test_the_tpu_vm_environment_sets_the_premapped_buffer_tpuray_recommends():
    """tpu-vm/env.sh (a shell file) repeats constants.TPU_HOST_TRANSFER_ENV: the two must agree."""
    text = (Path(__file__).resolve().parents[2] / "tpu-vm" / "env.sh").read_text()
    for name, value in TPU_HOST_TRANSFER_ENV:
        assert f"{name}=${{{name}:-{value}}}" in text
