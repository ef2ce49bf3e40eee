"""Slice fault tolerance: kill an emulated TPU host mid-fit; the trainer releases the slice, reserves a
whole slice again, restarts every worker from the latest checkpoint, and reports every epoch once. (A
worker process that dies while its peer waits in a collective is retried from the checkpoint too:
tests/train/test_callbacks.py::test_on_restart_after_a_worker_crash.)"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402

from _util import TWO_WORKERS_V6E_2X2  # noqa: E402
from tpuray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)


def _committed_checkpoint(run_dir: str) -> int | None:
    try:
        with open(os.path.join(run_dir, "run_state.json")) as f:
            return json.load(f)["latest_checkpoint"]
    except (OSError, ValueError):
        return None


def test_host_killed_mid_fit_resumes_from_checkpoint(emulated_cluster, pg_leak_check, tmp_path) -> None:
    marker, run_dir = tmp_path / "marker", tmp_path / "results" / "ft"
    trainer = TorchTrainer(
        _loops.resumable_loop,
        train_loop_config={"epochs": 5, "kill_after": 3, "marker": str(marker)},
        scaling_config=ScalingConfig(**TWO_WORKERS_V6E_2X2),  # half the processes to restart
        run_config=RunConfig(
            storage_path=str(tmp_path / "results"), name="ft", failure_config=FailureConfig(max_failures=1)
        ),
    )
    killed: dict = {}

    def killer() -> None:
        # Wait (no deadline assertions) until rank 0 has reported epoch 3 and the driver has committed
        # checkpoint_000002 (epoch 3), then hard-kill the host the workers run on.
        while not (marker.exists() and _committed_checkpoint(str(run_dir)) == 2):
            if killed.get("stop"):
                return
            time.sleep(0.2)
        node_id = marker.read_text()
        killed["node_id"] = node_id
        killed["token"] = emulated_cluster.kill_host(node_id)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        result = trainer.fit()
    finally:
        killed["stop"] = True
        thread.join()
        if "token" in killed:
            emulated_cluster.restore_host(killed["token"])

    assert "node_id" in killed, "the host was never killed"
    history = result.metrics_history
    assert [m["epoch"] for m in history] == [1, 2, 3, 4, 5]  # every epoch exactly once
    assert [m["attempt"] for m in history] == [0, 0, 0, 1, 1]
    assert [m["resumed_from"] for m in history[3:]] == [3, 3]
    assert result.num_failures == 1 and result.error is None
    assert result.checkpoint.path.endswith("checkpoint_000004")
    # The restarted run landed on a whole slice that does not include the dead host.
    dead_slice = history[0]["slice"]
    assert {m["node_id"] for m in history[:3]} == {killed["node_id"]}
    assert all(m["node_id"] != killed["node_id"] and m["slice"] != dead_slice for m in history[3:])
    assert {m["slice"] for m in history[3:]} <= {sl.name for sl in emulated_cluster.slices}
