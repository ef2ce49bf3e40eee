"""Ray Data ingestion: TorchTrainer(datasets=..., dataset_config=DataConfig(...)) and
get_dataset_shard() on the emulated cluster, with real Ray Data pipelines (streaming_split, map_batches)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import ray
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _data_loops  # noqa: E402
import _loops  # noqa: E402
from _examples import load_example  # noqa: E402

from _util import TWO_WORKERS_V6E_2X2  # noqa: E402
from tpuray.constants import ROLE_LABEL  # noqa: E402
from tpuray.emulator import SliceRequest  # noqa: E402
from tpuray.train import DataConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402
from tpuray.validation import ConfigError  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_data_loops)


@pytest.fixture(autouse=True)
def _quiet_ray_data():
    from ray.data import DataContext

    ctx = DataContext.get_current()
    before = ctx.enable_progress_bars
    ctx.enable_progress_bars = False
    yield
    ctx.enable_progress_bars = before


def _tagged(n: int, nodes_dir, blocks: int = 8):
    os.makedirs(nodes_dir, exist_ok=True)
    return ray.data.range(n, override_num_blocks=blocks).map_batches(
        _data_loops.tag_node, fn_kwargs={"out": str(nodes_dir)}, batch_format="numpy"
    )


def _ranks(out_dir, attempt: int = 0) -> list[dict]:
    docs = []
    rank = 0
    while (path := out_dir / f"shard-attempt{attempt}-rank{rank}.json").exists():
        docs.append(json.loads(path.read_text()))
        rank += 1
    return docs


def _map_nodes(nodes_dir) -> set[str]:
    return {p.read_text() for p in nodes_dir.glob("*.node")}


def _head_node_id() -> str:
    (head,) = [
        n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Labels", {}).get(ROLE_LABEL) == "head"
    ]
    return head


def _alive_split_coordinators() -> set[str]:
    actors = ray._private.state.actors(actor_state_name="ALIVE")
    return {a for a, info in actors.items() if info.get("ActorClassName") == "SplitCoordinator"}


def _assert_no_new_coordinators(before: set[str]) -> None:
    """The attempts' streaming_split coordinators were killed (the GCS records a kill asynchronously:
    allow it a moment to land, as pg_leak_check does)."""
    deadline = time.monotonic() + 10.0
    while (_alive_split_coordinators() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (_alive_split_coordinators() - before), "split coordinator actors leaked"


def _assert_each_row_once(ranks: list[dict], n: int, epochs: int) -> None:
    world = len(ranks)
    for epoch in range(epochs):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert [len(ids) for ids in per_rank] == [n // world] * world  # equal shards
        seen = [i for ids in per_rank for i in ids]
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: rows missing or repeated"


def test_split_every_row_once_per_epoch_on_2x2_and_again_after_a_restart(
    emulated_cluster, pg_leak_check, tmp_path
) -> None:
    """2 workers, 2 epochs, and rank 1's process dies mid-epoch on the first attempt: the restarted attempt
    gets a fresh split, so every row of "train" comes exactly once per epoch across its ranks, in equal
    shards, as torch tensors on the tpu device by default; "val" (not split) whole on every rank;
    map_batches ran on the CPU head only (not on the TPU hosts, which have CPUs too); no split coordinator
    of either attempt left."""
    nodes = tmp_path / "nodes"
    coordinators_before = _alive_split_coordinators()
    trainer = TorchTrainer(
        _data_loops.shard_loop,
        train_loop_config={"epochs": 2, "out_dir": str(tmp_path), "val": True, "crash_rank": 1},
        # two workers of two chips: the split's guarantees do not depend on a process per chip
        scaling_config=ScalingConfig(**TWO_WORKERS_V6E_2X2),
        run_config=RunConfig(
            storage_path=str(tmp_path / "results"),
            name="data2x2",
            failure_config=FailureConfig(max_failures=1),
            verbose=0,
        ),
        datasets={"train": _tagged(64, nodes), "val": _tagged(10, nodes, blocks=2)},
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    result = trainer.fit()
    assert result.num_failures == 1 and result.error is None
    # no checkpoint: both epochs again, and only the attempt that finished is in the history
    assert [(m["epoch"], m["attempt"]) for m in result.metrics_history] == [(1, 1), (2, 1)]
    ranks = _ranks(tmp_path, attempt=1)
    assert len(ranks) == 2
    _assert_each_row_once(ranks, 64, 2)
    assert all(r["devices"] == ["tpu"] and r["is_data_iterator"] for r in ranks)
    assert all(r["val"] == list(range(10)) for r in ranks)  # not split: every worker gets all of it
    assert _map_nodes(nodes) == {_head_node_id()}
    _assert_no_new_coordinators(coordinators_before)


def test_bad_dataset_config_is_a_clear_error(emulated_cluster) -> None:
    from ray.train import DataConfig as RayDataConfig

    ds = ray.data.range(8)
    loop = _data_loops.shard_loop
    with pytest.raises(ConfigError, match=r"\['nope'\].*valid: \['train'\]"):
        TorchTrainer(loop, datasets={"train": ds}, dataset_config=DataConfig(datasets_to_split=["nope"]))
    from ray.data import ExecutionOptions

    with pytest.raises(ConfigError, match=r"\['other'\]"):
        TorchTrainer(
            loop,
            datasets={"train": ds},
            dataset_config=DataConfig(execution_options={"other": ExecutionOptions()}),
        )
    with pytest.raises(ConfigError, match="datasets_to_split=7"):
        DataConfig(datasets_to_split=7)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="execution_options='fast'"):
        DataConfig(execution_options="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"execution_options\['train'\]=1"):
        DataConfig(execution_options={"train": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="enable_shard_locality='yes'"):
        DataConfig(enable_shard_locality="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"datasets\['train'\]=\[1, 2\]"):
        TorchTrainer(loop, datasets={"train": [1, 2]})
    with pytest.raises(ConfigError, match="without datasets"):
        TorchTrainer(loop, dataset_config=DataConfig())
    with pytest.raises(TypeError, match="tpuray.train.DataConfig"):
        TorchTrainer(loop, datasets={"train": ds}, dataset_config=RayDataConfig())


def test_get_dataset_shard_outside_a_run() -> None:
    from tpuray import train

    with pytest.raises(RuntimeError, match="only works inside train_loop_per_worker"):
        train.get_dataset_shard("train")


def test_the_worker_session_holds_the_shards(monkeypatch) -> None:
    from tpuray import train
    from tpuray.train import session

    monkeypatch.setattr(session, "_SESSION", None)  # the process's session: gone again after the test
    ctx = session.TrainContext(0, 1, 0, 1, 0, "shards", "/tmp", "/tmp")
    one, two = object(), object()
    session.start_session(ctx, None, 0, shards={"train": one})
    assert train.get_dataset_shard() is one and train.get_dataset_shard("train") is one
    with pytest.raises(KeyError, match=r"get_dataset_shard\('val'\): no such dataset.*\['train'\]"):
        train.get_dataset_shard("val")
    session.start_session(ctx, None, 0, shards={"train": one, "val": two})  # a new attempt's worker
    assert train.get_dataset_shard("val") is two
    with pytest.raises(KeyError, match="needs a dataset name"):
        train.get_dataset_shard()


@pytest.mark.full(
    "CI: Ray Data shards on 2x2 (test_split_every_row_once_per_epoch_on_2x2_...), multi-host slices (slices/test_layouts.py, train/test_preemption_recovery.py)"
)
@pytest.mark.slow
def test_seed_sample_and_split_on_emulated_4x4(cluster_manager, pg_leak_check, tmp_path) -> None:
    """The one tpuray.train test on a multi-host slice (16 workers on 4 emulated hosts; each 16-worker fit
    costs about a minute here, so one fit checks both): the seed sample (examples/train_seed.py) unchanged
    over tpu_dist with each rank's env, then Ray Data: every row exactly once per epoch, equal shards,
    map_batches on the CPU head."""
    (sl,) = cluster_manager.get(SliceRequest("TPU-V6E", "4x4"), head_cpus=2).slices
    ray.cloudpickle.register_pickle_by_value(_loops)
    example = load_example("train_seed.py")
    assert example.trainer.scaling_config.num_workers == 16
    nodes = tmp_path / "nodes"
    trainer = TorchTrainer(
        _data_loops.first_then_shards,
        train_loop_config={
            "first": _loops.env_dump_then,
            "seed_fn": example.train_fn_per_worker,
            "epochs": 2,
            "out_dir": str(tmp_path),
        },
        scaling_config=example.scaling_config,
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="seed4x4", verbose=0),
        datasets={"train": _tagged(256, nodes, blocks=16)},
    )
    result = trainer.fit()
    assert result.error is None

    seed = [m for m in result.metrics_history if "loss" in m]
    assert [m["epoch"] for m in seed] == list(range(1, 11))
    losses = [m["loss"] for m in seed]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    envs = sorted((json.load(open(p)) for p in tmp_path.glob("rank*.json")), key=lambda d: d["rank"])
    assert [r["rank"] for r in envs] == list(range(16))
    for r in envs:
        host, chip = divmod(r["rank"], 4)
        assert r["NODE_RANK"] == str(host) == r["TPU_WORKER_ID"]  # ranks ordered by host worker id
        assert r["LOCAL_RANK"] == r["TPU_VISIBLE_CHIPS"] == str(chip)
        assert r["WORLD_SIZE"] == "16" and r["LOCAL_WORLD_SIZE"] == "4"
        assert r["TORCH_TPU_TOPOLOGY"] and len(r["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) >= 4
        # every chip of the slice exactly once, on the host of its worker id, with the per-chip bounds
        assert r["CLOUD_TPU_TASK_ID"] == str(r["rank"]) and sl.node_ids[host] == r["node_id"]
        assert r["TPU_PROCESS_BOUNDS"] == "4,4,1" and r["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert (
            r["TPU_HOST_BOUNDS"] is None and r["TPURAY_EMULATION"] == "1"
        )  # Ray's single-host bounds dropped
    nodes_per_host: dict[str, set] = {}
    for r in envs:
        nodes_per_host.setdefault(r["node"], set()).add(r["node_id"])
    assert len(nodes_per_host) == 4 and all(len(v) == 1 for v in nodes_per_host.values())
    assert len({next(iter(v)) for v in nodes_per_host.values()}) == 4  # four distinct Ray nodes

    ranks = _ranks(tmp_path)
    assert len(ranks) == 16
    _assert_each_row_once(ranks, 256, 2)
    assert all(r["devices"] == ["tpu"] for r in ranks)
    assert _map_nodes(nodes) == {_head_node_id()}
