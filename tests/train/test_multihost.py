"""The seed sample on an emulated multi-host v6e 4x4 slice: 16 workers on 4 hosts, tpu_dist, 10 epochs."""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402
from _examples import load_example  # noqa: E402

from tpuray.emulator import SliceRequest  # noqa: E402
from tpuray.train import RunConfig  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402


def _load_example():
    return load_example("train_seed.py")


@pytest.mark.slow
def test_seed_sample_on_emulated_4x4(cluster_manager, pg_leak_check, tmp_path) -> None:
    cluster_manager.get(SliceRequest("TPU-V6E", "4x4"), head_cpus=2)
    ray.cloudpickle.register_pickle_by_value(_loops)
    example = _load_example()
    assert example.trainer.scaling_config.num_workers == 16

    trainer = TorchTrainer(
        _loops.env_dump_then,
        train_loop_config={"out_dir": str(tmp_path), "seed_fn": example.train_fn_per_worker},
        scaling_config=example.scaling_config,
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="seed4x4"),
    )
    result = trainer.fit()

    losses = [m["loss"] for m in result.metrics_history]
    assert [m["epoch"] for m in result.metrics_history] == list(range(1, 11))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses

    ranks = sorted((json.load(open(p)) for p in tmp_path.glob("rank*.json")), key=lambda d: d["rank"])
    assert [r["rank"] for r in ranks] == list(range(16))
    for r in ranks:
        host, chip = divmod(r["rank"], 4)
        assert r["NODE_RANK"] == str(host) == r["TPU_WORKER_ID"]  # ranks ordered by host worker id
        assert r["LOCAL_RANK"] == r["TPU_VISIBLE_CHIPS"] == str(chip)
        assert r["WORLD_SIZE"] == "16" and r["LOCAL_WORLD_SIZE"] == "4"
        assert r["TORCH_TPU_TOPOLOGY"] and len(r["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) >= 4
    nodes_per_host = {}
    for r in ranks:
        nodes_per_host.setdefault(r["node"], set()).add(r["node_id"])
    assert len(nodes_per_host) == 4 and all(len(v) == 1 for v in nodes_per_host.values())
    assert len({next(iter(v)) for v in nodes_per_host.values()}) == 4  # four distinct Ray nodes
