"""`tpuray plan`: text, JSON, PNG, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tpuray.cli import main


def test_text_report(capsys):
    assert main(["plan", "--accelerator-type", "TPU-V6E", "--topology", "4x4"]) == 0
    out = capsys.readouterr().out
    assert "v6e (Trillium) 4x4 - pod type v6e-16" in out
    assert "4 per slice, 4 chips each" in out
    assert "     0   1|  8   9" in out  # mesh row 0: workers 0 | 2 (worker 1 is below worker 0)
    assert "TPU_PROCESS_BOUNDS=4,4,1" in out and "TORCH_TPU_TOPOLOGY=4,4,1" in out
    assert "5     1       1     2,1,0   v6e-16-w1" in out  # rank layout row (hosts: first dim fastest)


def test_json_plan(capsys):
    assert main(["plan", "-a", "v5p", "-t", "2x2x2", "--json", "--chips-per-process", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["pod_type"] == "v5p-16" and plan["hosts"] == 2 and plan["chips"] == 8
    assert plan["host_bounds"] == [1, 1, 2] and plan["processes_per_slice"] == 4
    assert plan["layout"][5] == {"rank": 5, "host": 1, "local_chip": 1, "coords": [0, 1, 1]}
    common = plan["slices"][0]["env_common"]
    assert common["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    assert common["TPU_WORKER_HOSTNAMES"] == "v5p-16-w0,v5p-16-w1"
    assert plan["per_process"][3] == {
        "rank": 3, "TPU_WORKER_ID": "1", "TPU_VISIBLE_CHIPS": "2,3", "TPU_PROCESS_PORT": "8477",
        "CLOUD_TPU_TASK_ID": "3",
    }  # fmt: skip


def test_multislice_json(capsys):
    assert main(["plan", "-a", "TPU-V6E", "-t", "2x2", "--num-slices", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    s0, s1 = plan["slices"]
    assert s0["hostnames"] == ["v6e-4-s0"] and s1["hostnames"] == ["v6e-4-s1"]
    assert s1["env_common"]["MEGASCALE_SLICE_ID"] == "1"
    assert s1["env_common"]["MEGASCALE_COORDINATOR_ADDRESS"] == "v6e-4-s0"
    assert s1["env_common"]["TPU_PROCESS_ADDRESSES"].startswith("v6e-4-s1:8476")


def test_hostnames_option(capsys):
    assert main(["plan", "-a", "v6e", "-t", "4x4", "--hostnames", "a,b,c,d", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["slices"][0]["env_common"]["TPU_WORKER_HOSTNAMES"] == "a,b,c,d"


def test_png(tmp_path, capsys):
    png = tmp_path / "mesh.png"
    assert main(["plan", "-a", "v4", "-t", "2x2x2", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"mesh drawn to {png}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-a", "TPU-V6E", "-t", "3x3"], "'3x3' is not valid for v6e"),
        (["-a", "TPU-V9", "-t", "4x4"], "unknown TPU accelerator type 'TPU-V9'"),
        (["-a", "v6e", "-t", "four"], "malformed topology 'four'"),
        (["-a", "v6e", "-t", "4x4", "--chips-per-process", "8"], "--chips-per-process=8"),
        (["-a", "v6e", "-t", "4x4", "--hostnames", "a,b"], "hostnames must list 4"),
        (["-a", "v6e", "-t", "4x4", "--num-slices", "0"], "--num-slices=0"),
        (["-a", "v6e", "-t", "2x2", "--png", "/nonexistent-dir/x.png"], "does not exist"),
        (["-a", "v6e", "-t", "2x2", "--png", "mesh.jpg"], "must end in .png"),
    ],
)
def test_bad_input_exit_2_one_line(args, needle, capsys):
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("tpuray plan: error:") and needle in err


def test_subprocess_entry_point():
    """The real command line, as a user runs it (also checks --help has an example)."""
    run = [sys.executable, "-m", "tpuray.cli", "plan"]
    ok = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True)
    assert "tpuray plan --accelerator-type TPU-V6E --topology 4x4" in ok.stdout
    bad = subprocess.run([*run, "-a", "v6e", "-t", "5x5"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'5x5'" in bad.stderr
