"""Spot preemption of an emulated slice mid-fit: Ray's drain notice reaches the loop, the loop checkpoints,
the trainer releases the slice, reserves the spare one, and resumes from that checkpoint with no step
before the notice lost; preemptions count against max_preemption_failures, not max_failures (one fit,
preempted twice)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402

from _util import TWO_WORKERS_V6E_2X2  # noqa: E402
from tpuray.train import FailureConfig, RunConfig, ScalingConfig, WorkerGroupError  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)
SCALING = TWO_WORKERS_V6E_2X2  # preemption handling does not depend on one process per chip


def _fit_with_preemptions(cluster, tmp_path, failure_config: FailureConfig, signal_at: list[int]):
    """fit() while a thread preempts the slice rank 0 runs on once attempt i made signal_at[i] steps; returns (result or error, [(preemption, notice time)]). The preempted slices are brought
    back before returning."""
    marker = tmp_path / "marker"
    trainer = TorchTrainer(
        _loops.preemptible_loop,
        train_loop_config={"steps": 25, "step_s": 0.2, "signal_at": signal_at, "marker": str(marker)},
        scaling_config=ScalingConfig(**SCALING),
        run_config=RunConfig(
            storage_path=str(tmp_path), name="spot", failure_config=failure_config, verbose=0
        ),
    )
    seen: dict = {"preemptions": []}

    def preempt() -> None:
        for attempt in range(len(signal_at)):
            path = marker.with_name(marker.name + (f".{attempt}" if attempt else ""))
            while not (path.exists() and path.read_text()):
                if seen.get("stop"):
                    return
                time.sleep(0.05)
            try:
                node_id = path.read_text()
                name = next(sl.name for sl in cluster.slices if node_id in sl.node_ids)
                noticed = time.time()
                seen["preemptions"].append((cluster.preempt_slice(name, notice_s=5.0), noticed))
            except Exception as exc:  # reported by the assertion below, not lost in a thread
                seen["error"] = f"{type(exc).__name__}: {exc} (slices: {cluster.slices})"
                return

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
        for preemption, _ in seen["preemptions"]:
            preemption.restore()  # GKE's node pool brings the slice back
    done = len(seen["preemptions"])
    assert done == len(signal_at), (
        f"{done} of {len(signal_at)} preemptions: {seen.get('error')}; {_summary(outcome)}"
    )
    return outcome, seen["preemptions"]


def _summary(outcome) -> str:
    """What the run did (for an assertion's message): its error, counts and each attempt's steps."""
    result = getattr(outcome, "result", outcome)
    steps: dict = {}
    for m in getattr(result, "metrics_history", None) or []:
        steps.setdefault(m["attempt"], []).append(m["step"])
    counts = {k: getattr(result, k, None) for k in ("num_failures", "num_preemptions", "error")}
    return f"fit gave {type(outcome).__name__} {counts}, steps per attempt {steps}"


def test_preempted_slice_resumes_on_the_spare_and_preemptions_count_apart(
    emulated_cluster, pg_leak_check, tmp_path
):
    """The slice of attempt 0 is preempted at step 5: the loop sees the notice, checkpoints, and the run
    resumes on the spare slice with no step lost; that slice is preempted in turn (3 steps after the
    resumption), which is one more preemption than max_preemption_failures=1 allows, while max_failures=5
    is untouched."""
    error, preemptions = _fit_with_preemptions(
        emulated_cluster, tmp_path, FailureConfig(max_failures=5, max_preemption_failures=1), [5, 3]
    )
    assert isinstance(error, WorkerGroupError), _summary(error)
    assert "max_preemption_failures=1" in str(error) and "preempted" in str(error)
    result = error.result
    assert result.num_preemptions == 2 and result.num_failures == 0
    assert result.checkpoint is not None  # the checkpoint the second notice asked for was committed
    history = result.metrics_history
    steps = [m["step"] for m in history]
    assert steps == list(range(1, len(steps) + 1))  # every step exactly once
    assert all(m["sum"] == 2.0 for m in history)  # the all_reduce really ran across the 2 workers
    first = [m for m in history if m["attempt"] == 0]
    resumed = [m for m in history if m["attempt"] == 1]
    for attempt, (preemption, _) in zip((first, resumed), preemptions, strict=True):
        # The loop saw the notice (Ray's shape: deadline, every rank of the slice) and checkpointed.
        told = [m for m in attempt if m["notice_deadline_ms"] is not None]
        assert told and told[0]["notice_deadline_ms"] == int(preemption.deadline * 1000)
        assert told[0]["notice_ranks"] == [0, 1]
    # No step made before the first notice was lost: the run resumed at or after the last one ...
    (preemption, noticed) = preemptions[0]
    assert resumed[0]["resumed_from"] >= max(m["step"] for m in first if m["t"] < noticed)
    assert steps[-1] >= resumed[0]["resumed_from"] + 3  # attempt 1 ran until its own notice
    # ... before the deadline (loose: only orders the events), on the other (spare) slice.
    assert resumed[0]["t"] < preemption.deadline + 60
    assert {m["slice"] for m in resumed} != {first[0]["slice"]}
    assert all(m["node_id"] not in preemption.node_ids for m in resumed)


def test_preemption_api_outside_a_run() -> None:
    from tpuray import train

    with pytest.raises(RuntimeError, match="get_preemption_info"):
        train.get_preemption_info()
    with pytest.raises(ValueError, match="max_preemption_failures=-2"):
        FailureConfig(max_preemption_failures=-2)
