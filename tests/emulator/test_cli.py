"""`tpuray emulate up|status|preempt|down` and `tpuray status`, run as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tpuray.emulator.detached import _alive


def _tpuray(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpuray.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_bad_topology_is_a_usage_error(tmp_path) -> None:
    out = _tpuray("emulate", "up", "--topology", "3x3", "--state-dir", str(tmp_path))
    assert out.returncode == 2 and "3x3" in out.stderr and "valid" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing started


def test_bad_num_slices_is_a_usage_error(tmp_path) -> None:
    out = _tpuray("emulate", "up", "--topology", "2x2", "--num-slices", "0", "--state-dir", str(tmp_path))
    assert out.returncode == 2 and "--num-slices=0 is invalid: use an integer >= 1" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing started


def test_bad_autoscale_flags_are_usage_errors(tmp_path) -> None:
    state = ["--state-dir", str(tmp_path)]
    alone = _tpuray("emulate", "up", "--max-slices", "TPU-V6E:2x2=1", *state)
    assert alone.returncode == 2 and "only valid with --autoscale" in alone.stderr
    bare = _tpuray("emulate", "up", "--autoscale", *state)
    assert bare.returncode == 2 and "--autoscale needs --max-slices TYPE:TOPOLOGY=N" in bare.stderr
    bad = _tpuray("emulate", "up", "--autoscale", "--max-slices", "TPU-V6E:3x3=1", *state)
    assert bad.returncode == 2 and "3x3" in bad.stderr and "valid" in bad.stderr
    shape = _tpuray("emulate", "up", "--autoscale", "--max-slices", "v6e-2x2", *state)
    assert shape.returncode == 2 and "'v6e-2x2' is invalid: use TYPE:TOPOLOGY=N" in shape.stderr
    again = _tpuray(
        "emulate", "up", "--autoscale", "--max-slices", "v6e:2x2=1", "--max-slices", "v6e:2x2=4", *state
    )
    assert again.returncode == 2 and "names 'v6e:2x2' again: give each shape once" in again.stderr
    assert not any(tmp_path.iterdir())  # nothing started
    helped = _tpuray("emulate", "--help")
    assert "--max-slices TYPE:TOPOLOGY=N" in helped.stdout and "Ray's own autoscaler" in helped.stdout


def test_bad_cores_are_usage_errors(tmp_path) -> None:
    state = ["--state-dir", str(tmp_path)]
    auto = _tpuray(
        "emulate", "up", "--cores", "per_slice", "--autoscale", "--max-slices", "v6e:2x2=1", *state
    )
    assert auto.returncode == 2 and "Ray's autoscaler starts its slices itself" in auto.stderr
    many = str(len(os.sched_getaffinity(0)) + 1)
    crowded = _tpuray("emulate", "up", "--cores", "per_slice", "--num-slices", many, *state)
    assert crowded.returncode == 2 and f"each of the {many} slices cores of its own" in crowded.stderr
    bad = _tpuray("emulate", "up", "--cores", "pinned", *state)
    assert bad.returncode == 2 and "invalid choice: 'pinned'" in bad.stderr
    assert not any(tmp_path.iterdir())  # nothing started


def test_status_lists_emulated_slices_and_who_holds_them(emulated_cluster, pg_leak_check) -> None:
    from tpuray.slices import SlicePlacementGroup, holder_name

    name = holder_name("train", "status-check")
    held = SlicePlacementGroup("2x2", "v6e", name=name)
    try:
        out = _tpuray("status", "--address", emulated_cluster.address)
    finally:
        held.shutdown()
    assert out.returncode == 0, out.stderr
    for s in emulated_cluster.slices:
        assert s.name in out.stdout
    assert "EMULATED" in out.stdout and "v6e" in out.stdout.lower() and "HELD BY" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith(held.slice_names[0]))
    assert row.endswith(name) and name.startswith("train:status-check#") and " busy " in row


def test_emulate_up_status_down(tmp_path) -> None:
    state = ["--state-dir", str(tmp_path)]
    # One fixed slice, and Ray's autoscaler for more on demand (docs/autoscaling.md).
    up = _tpuray("emulate", "up", "--topology", "2x2", "--head-cpus", "1", "--num-slices", "1",
                 "--autoscale", "--max-slices", "TPU-V6E:2x2=1", *state)  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "EMULATED" in up.stdout and "emulated-v6e-4-0" in up.stdout
        assert "autoscale: tpu-v6e-4 (TPU-V6E 2x2, 1 host(s)) x 1" in up.stdout
        from tpuray.emulator.detached import read_state

        info = read_state(tmp_path)
        assert info and info["emulated"] and info["ray_pids"]
        # Ray's own tools work against it (its dashboard is on by default; --no-dashboard turns it off)
        assert f"Ray dashboard: {info['dashboard']}" in up.stdout and info["dashboard"].startswith("http://")
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        actors = subprocess.run([ray_cli, "list", "actors"], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "RAY_ADDRESS": info["address"]})  # fmt: skip
        assert actors.returncode == 0, actors.stdout + actors.stderr
        again = _tpuray("emulate", "up", *state)
        assert again.returncode == 1 and "already running" in again.stdout
        status = _tpuray("emulate", "status", *state)
        assert status.returncode == 0 and info["address"] in status.stdout
        # Emulated spot preemption through the running cluster: drained now, killed after 1 s, back after.
        old_ids = info["slices"][0]["node_ids"]
        spot = _tpuray("emulate", "preempt", "--slice", "emulated-v6e-4-0", "--notice-s", "1", *state,
                       "--restore-after-s", "0")  # fmt: skip
        assert spot.returncode == 0, spot.stdout + spot.stderr
        assert "EMULATED preemption of slice emulated-v6e-4-0: 1 host(s) draining" in spot.stdout
        deadline = time.monotonic() + 180
        while read_state(tmp_path)["slices"][0]["node_ids"] == old_ids:  # the replacement host joined
            assert time.monotonic() < deadline, "the preempted host never came back"
            time.sleep(0.5)
        bad = _tpuray("emulate", "preempt", "--slice", "nope", *state)
        assert bad.returncode == 2 and "no emulated slice 'nope'" in bad.stderr
        neither = _tpuray("emulate", "preempt", *state)
        assert neither.returncode == 2 and "--slice NAME or --node-id" in neither.stderr
    finally:
        down = _tpuray("emulate", "down", *state)
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not _alive(info["pid"])
    assert not [pid for pid in info["ray_pids"] if _alive(pid)]  # no raylet / GCS survives
    assert _tpuray("emulate", "status", *state).returncode == 1
