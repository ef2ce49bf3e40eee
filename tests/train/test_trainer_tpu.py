"""TorchTrainer on CPU workers (gloo) and its errors: real Ray, real torch. (The seed loop on an emulated
v6e 2x2 slice over tpu_dist: tests/train/test_callbacks.py, whose callbacks watch that same fit.)"""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)  # workers cannot import tests/train/_loops.py by name

from _util import alive_actors  # noqa: E402
from tpuray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402


def test_user_error_surfaces_with_traceback_and_is_not_retried(
    emulated_cluster, pg_leak_check, tmp_path
) -> None:
    trainer = TorchTrainer(
        _loops.failing_loop,
        train_loop_config={"bad_rank": 1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path), name="boom", failure_config=FailureConfig(max_failures=3), verbose=0
        ),
    )
    with pytest.raises(TrainingFailedError) as err:
        trainer.fit()
    message = str(err.value)
    assert "worker rank 1 raised" in message and "boom at epoch 2 on rank 1" in message
    assert "failing_loop" in message and "Traceback" in message
    assert isinstance(err.value.worker_failures[1], ValueError)
    assert err.value.result.error is err.value and err.value.result.num_failures == 0
    assert not alive_actors("TrainWorker")


def test_cpu_gloo_data_loader_shards(emulated_cluster, pg_leak_check, tmp_path) -> None:
    trainer = TorchTrainer(
        _loops.data_loader_loop,
        train_loop_config={"out_dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), verbose=0),
    )
    result = trainer.fit()
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(16))
    assert all(r["batches"] == 2 and r["devices"] == ["cpu"] for r in ranks)
    assert result.metrics == {"n": 8}
