"""Spot preemption of an emulated slice mid-fit: Ray's drain notice reaches the loop, the loop checkpoints,
the trainer releases the slice, reserves the spare one, and resumes from that checkpoint with no step
before the notice lost; preemptions count against max_preemption_failures, not max_failures."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402

from tpuray.train import FailureConfig, RunConfig, ScalingConfig, WorkerGroupError  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)
SCALING = dict(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E")


def _fit_with_preemption(cluster, tmp_path, failure_config: FailureConfig, notice_s: float = 5.0):
    """fit() while a thread preempts the slice rank 0 runs on (after its 5th step); returns (result or
    error, preemption, notice time). The preempted slice is brought back before returning."""
    marker = tmp_path / "marker"
    trainer = TorchTrainer(
        _loops.preemptible_loop,
        train_loop_config={"steps": 25, "step_s": 0.2, "signal_at": 5, "marker": str(marker)},
        scaling_config=ScalingConfig(**SCALING),
        run_config=RunConfig(
            storage_path=str(tmp_path), name="spot", failure_config=failure_config, verbose=0
        ),
    )
    seen: dict = {}

    def preempt() -> None:
        while not (marker.exists() and marker.read_text()):
            if seen.get("stop"):
                return
            time.sleep(0.05)
        try:
            node_id = marker.read_text()
            name = next(sl.name for sl in cluster.slices if node_id in sl.node_ids)
            seen["t"] = time.time()
            seen["preemption"] = cluster.preempt_slice(name, notice_s=notice_s)
        except Exception as exc:  # reported by the assertion below, not lost in a thread
            seen["error"] = f"{type(exc).__name__}: {exc} (slices: {cluster.slices})"

    thread = threading.Thread(target=preempt, daemon=True)
    thread.start()
    try:
        try:
            outcome = trainer.fit()
        except WorkerGroupError as e:
            outcome = e
    finally:
        seen["stop"] = True
        thread.join()
        if "preemption" in seen:
            seen["preemption"].restore()  # GKE's node pool brings the slice back
    assert "preemption" in seen, f"the slice was never preempted: {seen.get('error')}; {_summary(outcome)}"
    return outcome, seen["preemption"], seen["t"]


def _summary(outcome) -> str:
    """What the run did (for an assertion's message): its error, counts and each attempt's steps."""
    result = getattr(outcome, "result", outcome)
    steps: dict = {}
    for m in getattr(result, "metrics_history", None) or []:
        steps.setdefault(m["attempt"], []).append(m["step"])
    counts = {k: getattr(result, k, None) for k in ("num_failures", "num_preemptions", "error")}
    return f"fit gave {type(outcome).__name__} {counts}, steps per attempt {steps}"


def test_preempted_slice_checkpoints_and_resumes_on_spare_slice(emulated_cluster, pg_leak_check, tmp_path):
    result, preemption, noticed = _fit_with_preemption(
        emulated_cluster, tmp_path, FailureConfig(max_failures=0)
    )
    history = result.metrics_history
    assert [m["step"] for m in history] == list(range(1, 26))  # every step exactly once
    assert result.num_preemptions == 1 and result.num_failures == 0 and result.error is None
    assert all(m["sum"] == 4.0 for m in history)  # the all_reduce really ran across the 4 workers
    first = [m for m in history if m["attempt"] == 0]
    resumed = [m for m in history if m["attempt"] == 1]
    # The loop saw the notice (Ray's shape: deadline, every rank of the slice) and checkpointed.
    told = [m for m in first if m["notice_deadline_ms"] is not None]
    assert told and told[0]["notice_deadline_ms"] == int(preemption.deadline * 1000)
    assert told[0]["notice_ranks"] == [0, 1, 2, 3]
    # No step made before the notice was lost: the run resumed at or after the last one.
    last_before_notice = max(m["step"] for m in first if m["t"] < noticed)
    assert resumed[0]["resumed_from"] >= last_before_notice
    # ... and it resumed before the deadline, on the other (spare) slice.
    assert resumed[0]["t"] < preemption.deadline + 60  # loose: only orders the events, not a timing
    assert {m["slice"] for m in resumed} != {first[0]["slice"]}
    assert all(m["node_id"] not in preemption.node_ids for m in resumed)


def test_preemptions_count_against_max_preemption_failures(emulated_cluster, pg_leak_check, tmp_path):
    error, _, _ = _fit_with_preemption(
        emulated_cluster, tmp_path, FailureConfig(max_failures=5, max_preemption_failures=0)
    )
    assert isinstance(error, WorkerGroupError)
    assert "max_preemption_failures=0" in str(error) and "preempted" in str(error)
    assert error.result.num_preemptions == 1 and error.result.num_failures == 0
    assert error.result.checkpoint is not None  # the checkpoint it asked for was committed


def test_preemption_api_outside_a_run() -> None:
    from tpuray import train

    with pytest.raises(RuntimeError, match="get_preemption_info"):
        train.get_preemption_info()
    with pytest.raises(ValueError, match="max_preemption_failures=-2"):
        FailureConfig(max_preemption_failures=-2)
