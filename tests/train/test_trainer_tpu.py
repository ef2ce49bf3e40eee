"""TorchTrainer on an emulated v6e 2x2 slice (tpu_dist) and on CPU workers (gloo): real Ray, real torch."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)  # workers cannot import tests/train/_loops.py by name

from tpuray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402

TPU_2x2 = dict(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E")


def _read_ranks(out_dir) -> list[dict]:
    docs = [json.load(open(p)) for p in glob.glob(os.path.join(out_dir, "rank*.json"))]
    return sorted(docs, key=lambda d: d["rank"])


def _alive_train_workers() -> list:
    import ray._private.state as state

    return [
        a for a in state.actors().values() if a["State"] != "DEAD" and "TrainWorker" in a["ActorClassName"]
    ]


def test_seed_loop_on_emulated_2x2(emulated_cluster, pg_leak_check, tmp_path) -> None:
    out = tmp_path / "env"
    out.mkdir()
    trainer = TorchTrainer(
        _loops.seed_loop,
        train_loop_config={"out_dir": str(out), "checkpoint": True, "epochs": 6},
        scaling_config=ScalingConfig(resources_per_worker={"TPU": 1}, **TPU_2x2),
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}/results",
            name="seed",
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()

    losses = [m["loss"] for m in result.metrics_history]
    assert [m["epoch"] for m in result.metrics_history] == list(range(1, 7))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert result.metrics == result.metrics_history[-1] and result.error is None
    assert result.return_value == "finished"

    ranks = _read_ranks(out)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["RANK"] == str(r["rank"]) and r["WORLD_SIZE"] == "4" and r["world"] == 4
        assert (
            r["LOCAL_RANK"] == r["TPU_VISIBLE_CHIPS"] == str(r["local"])
        )  # TorchTPU binds the chip from LOCAL_RANK
        assert r["LOCAL_WORLD_SIZE"] == "4" and r["NODE_RANK"] == "0" and r["node"] == 0
        assert r["TORCH_TPU_TOPOLOGY"] and r["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
        assert r["TPURAY_EMULATION"] == "1" and r["device"] == "tpu"
        assert r["model"] == "DistributedDataParallel"
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1
    assert len({r["TORCH_TPU_SLICEBUILDER_ADDRESSES"] for r in ranks}) == 1

    # Checkpoints: persisted under storage/name, only the newest two kept, the result points at the last.
    run_dir = tmp_path / "results" / "seed"
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_000004", "checkpoint_000005"]
    assert result.checkpoint.path.endswith("checkpoint_000005") and result.path.endswith("seed")
    import torch

    with result.checkpoint.as_directory() as d:
        assert torch.load(os.path.join(d, "state.pt"))["epoch"] == 6
    assert json.load(open(run_dir / "run_state.json"))["finished"] is True
    assert not _alive_train_workers()


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
    assert not _alive_train_workers()


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
