"""Asynchronous checkpoint upload in real runs (2 CPU workers on the emulated cluster): every checkpoint
is complete although each loop deletes its directory right after report(); a checkpoint whose upload
failed or whose worker died mid-upload is never committed, and the run resumes from the previous one."""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _upload_loops  # noqa: E402

from tpuray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, WorkerGroupError  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_upload_loops)


def _trainer(tmp_path, name: str, config: dict, **run) -> TorchTrainer:
    return TorchTrainer(
        _upload_loops.checkpoint_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name=name, verbose=0, **run),
    )


def _run_state(run_dir) -> dict:
    return json.loads((run_dir / "run_state.json").read_text())


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_checkpoint_complete(emulated_cluster, tmp_path, mode: str) -> None:
    trainer = _trainer(
        tmp_path, mode, {"epochs": 3}, checkpoint_config=CheckpointConfig(checkpoint_upload_mode=mode)
    )
    result = trainer.fit()
    assert result.error is None and [m["epoch"] for m in result.metrics_history] == [1, 2, 3]
    for index in range(3):
        d = tmp_path / mode / f"checkpoint_{index:06d}"
        assert sorted(os.listdir(d)) == ["rank0.bin", "rank1.bin", "state.json", "z.bin"]
        for rank in (0, 1):
            assert (d / f"rank{rank}.bin").read_bytes() == f"rank {rank} epoch {index + 1}".encode()
    assert result.checkpoint.path.endswith("checkpoint_000002")
    assert _run_state(tmp_path / mode)["latest_checkpoint"] == 2


def test_upload_failing_mid_way_is_not_committed_and_resume_uses_the_previous(
    emulated_cluster, tmp_path
) -> None:
    with pytest.raises(
        WorkerGroupError, match=r"CheckpointUploadError.*checkpoint_000002.*not committed"
    ) as info:
        _trainer(tmp_path, "fail", {"epochs": 3, "obstacle_at": 3}).fit()
    result = info.value.result
    assert result.checkpoint.path.endswith("checkpoint_000001")  # not the half-uploaded checkpoint_000002
    assert _run_state(tmp_path / "fail")["latest_checkpoint"] == 1
    assert (tmp_path / "fail" / "checkpoint_000002" / "rank0.bin").exists()  # half of it is there

    resumed = _trainer(tmp_path, "fail", {"epochs": 3}).fit()  # same name: resumes the run
    assert [m["epoch"] for m in resumed.metrics_history] == [1, 2, 3]
    assert resumed.metrics_history[-1]["resumed_from"] == 2  # from checkpoint_000001 (epoch 2)
    assert (tmp_path / "fail" / "checkpoint_000002" / "z.bin").is_file()


def test_worker_killed_mid_upload_resumes_from_the_previous_checkpoint(emulated_cluster, tmp_path) -> None:
    trainer = _trainer(
        tmp_path, "killed", {"epochs": 4, "die_at": 3}, failure_config=FailureConfig(max_failures=1)
    )
    result = trainer.fit()
    history = result.metrics_history
    assert result.num_failures == 1
    assert [m["epoch"] for m in history] == [1, 2, 3, 4]
    assert [m["attempt"] for m in history] == [0, 0, 1, 1]
    assert [m["resumed_from"] for m in history[2:]] == [2, 2]  # checkpoint_000002 was never committed
    final = tmp_path / "killed" / "checkpoint_000003"
    assert sorted(os.listdir(final)) == ["rank0.bin", "rank1.bin", "state.json", "z.bin"]
    assert not (tmp_path / "killed" / "checkpoint_000002" / "big.bin").exists()  # attempt 0's was dropped


def test_upload_stuck_past_the_timeout_is_a_worker_failure_and_retried(
    emulated_cluster, tmp_path, monkeypatch
) -> None:
    """The storage stops answering mid-upload: past $TPURAY_TRAIN_UPLOAD_TIMEOUT_S the worker's report()
    raises CheckpointUploadTimeout, and the trainer restarts (a worker failure) instead of hanging."""
    from tpuray.constants import UPLOAD_TIMEOUT_ENV

    monkeypatch.setenv(UPLOAD_TIMEOUT_ENV, "2")  # read by the driver, handed to the workers
    _upload_loops.register_stuck_storage()  # the driver reads and writes the run's files there too
    flag = tmp_path / "hang-once"
    flag.write_text("")
    trainer = TorchTrainer(
        _upload_loops.stuck_storage_loop,
        train_loop_config={"flag": str(flag)},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(
            storage_path=f"tpuray-stuck://{tmp_path}/runs",
            name="stuck",
            failure_config=FailureConfig(max_failures=1),
            verbose=0,
        ),
    )
    result = trainer.fit()
    assert not flag.exists()  # the storage did hang once
    assert result.error is None and result.num_failures == 1
    assert [(m["epoch"], m["attempt"]) for m in result.metrics_history] == [(1, 1), (2, 1)]
    assert result.checkpoint.path.endswith("checkpoint_000001")
