"""The emulated tpu device in a single process.

Fresh interpreters run tests/runtime/_device_checks.py (process startup dominates on a busy machine): one
with TPURAY_EMULATION=1 runs the device checks, one without it checks the not-available error and the
explicit activate(), one checks torch.compile.
"""

from __future__ import annotations

import json

import pytest

from conftest import HERE, run_python


def _checks(name: str, emulation: bool = True) -> dict:
    proc = run_python(args=[str(HERE / "_device_checks.py"), name], emulation=emulation)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def emulated() -> dict:
    return _checks("emulated")


@pytest.fixture(scope="module")
def plain() -> dict:
    return _checks("plain", emulation=False)


def test_tensors_live_on_the_labelled_device(emulated):
    assert emulated["type"] == "TpuTensor" and emulated["device"] == "tpu:0"
    assert "emulated" in emulated["repr"] and "tpu:0" in emulated["repr"]
    assert "EMULATED" in emulated["module"]
    assert emulated["avail"] == [True, 1, 0]


def test_factories(emulated):
    assert emulated["numpy"] == [[3.0, 3.0], [3.0, 3.0]]
    assert emulated["randn_matches_cpu"]
    assert emulated["arange"] == [0, 1, 2, 3] and emulated["zeros_int"] == "torch.int64"


def test_copies_between_devices(emulated):
    assert emulated["to_tpu"] == ["tpu:0", True, True, "cpu"]
    assert emulated["item"] == 1.0 and emulated["copy_"] == [1.0, 2.0, 3.0]
    assert emulated["zeros_like_cpu"] == "cpu"
    assert emulated["save_load"] == ["tpu:0", True]


def test_views_write_their_base(emulated):
    assert emulated["view_inplace"] == [[4.0, 4.0], [4.0, 4.0]]
    assert emulated["setitem"] == [[4.0, 4.0], [7.0, 4.0]]
    assert emulated["tolist"] == [[4.0, 4.0], [7.0, 4.0]]


def test_ops_and_autocast(emulated):
    assert emulated["ops"] == [[7.0], [[1, 0]], [[-4.0, -4.0], [7.0, -4.0]], 4, "tpu"]
    assert emulated["autocast"] == ["torch.bfloat16", "torch.float32"]


def test_unsupported_uses_explain_themselves(emulated):
    assert "Use Tensor.cpu()" in emulated["numpy_error"]
    assert "resizing a tensor on the emulated tpu device in place is not supported" in emulated["resize"]


def test_training_matches_cpu(emulated):
    """A few AdamW steps on the emulated device give exactly the CPU's numbers."""
    l_cpu, l_tpu = emulated["train_losses"]
    assert l_cpu == l_tpu and l_tpu[0] > l_tpu[-1]
    assert emulated["train_params_equal"]


def test_without_emulation_tpu_dist_explains_itself(plain):
    assert not plain["tpu_before"], "tpu device registered without TPURAY_EMULATION"
    msg = plain["init_error"]
    assert "tpu_dist" in msg and "tpuray[tpu]" in msg and "tpuray emulate up" in msg
    assert "TPURAY_EMULATION=1" in msg and "TPURAY_EMULATION is unset" in msg


def test_activate_explicitly_and_visible_chips(plain):
    assert not plain["tpu_after_import"]
    assert plain["activate"] == ["emulated", "emulated", True, "1"]
    assert plain["device_count"] == 2 and plain["set_device_1"] == "tpu:1"
    assert "out of range" in plain["set_device_2"] and "TPU_VISIBLE_CHIPS='2,3'" in plain["set_device_2"]


def test_torch_compile_on_the_emulated_device():
    """torch.compile (AOTAutograd, and inductor's CPU kernels) sees through the wrapper: same numbers,
    outputs and gradients stay on the tpu device."""
    r = _checks("compile")
    for backend in ("aot_eager", "inductor"):
        assert r[backend] == ["TpuTensor", "tpu:0", True, True, "tpu:0"], (backend, r[backend])
