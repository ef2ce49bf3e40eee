"""CheckpointConfig(num_to_keep, checkpoint_score_attribute, checkpoint_score_order): the best N committed
checkpoints stay on disk (plus the latest), Result.best_checkpoints ranks them (worst first, as Ray), and a
run resumed under the same name keeps ranking the checkpoints of the earlier fit()."""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _tracking_loops  # noqa: E402

from tpuray.train import Checkpoint, CheckpointConfig, Result, RunConfig, ScalingConfig  # noqa: E402
from tpuray.train import checkpoint as ckpt  # noqa: E402
from tpuray.train.checkpoint.manager import CheckpointManager, RunState  # noqa: E402
from tpuray.validation import ConfigError  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_tracking_loops)


def _index(checkpoint: Checkpoint) -> int:
    return int(checkpoint.path.rsplit("_", 1)[-1])


def test_checkpoint_config_validation() -> None:
    cc = CheckpointConfig()
    assert (cc.num_to_keep, cc.checkpoint_score_attribute, cc.checkpoint_score_order) == (None, None, "max")
    assert CheckpointConfig(2, "val/acc", "min").checkpoint_score_order == "min"
    with pytest.raises(
        ConfigError, match="checkpoint_score_order='maximum' is not valid; valid: 'max', 'min'"
    ):
        CheckpointConfig(checkpoint_score_order="maximum")
    for bad in ("", 3):
        with pytest.raises(ConfigError, match=f"checkpoint_score_attribute={bad!r} is invalid"):
            CheckpointConfig(checkpoint_score_attribute=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_to_keep=0"):
        CheckpointConfig(num_to_keep=0, checkpoint_score_attribute="acc")


def _manager(tmp_path, world_size: int = 1, **config) -> tuple[CheckpointManager, RunState]:
    return CheckpointManager(CheckpointConfig(**config), str(tmp_path)), RunState(world_size)


def _commit(manager: CheckpointManager, state: RunState, index: int, metrics: dict) -> list[int]:
    os.makedirs(ckpt.checkpoint_dir(manager.run_path, index))
    state.ckpt_indices.add(index)
    state.latest_ckpt = index
    manager.register(index, metrics)
    return manager.prune(state)


def test_best_n_plus_latest_ties_nan_and_order(tmp_path) -> None:
    manager, state = _manager(tmp_path, num_to_keep=2, checkpoint_score_attribute="acc")
    dropped = []
    for index, acc in enumerate([0.5, 0.9, 0.7, 0.9, float("nan"), 0.1]):
        dropped += _commit(manager, state, index, {"acc": acc})
    # Best two: the two 0.9s (the newer ranks higher); the latest (0.1) is kept although it is the worst.
    assert ckpt.list_checkpoints(str(tmp_path)) == [1, 3, 5]
    assert sorted(dropped) == [0, 2, 4]
    assert [(_index(c), m["acc"]) for c, m in manager.best_checkpoints()] == [(1, 0.9), (3, 0.9)]
    assert [r["index"] for r in state.checkpoint_records] == [5, 1, 3]  # worst first, persisted as is
    # Once a newer checkpoint comes, the superseded latest goes if it is not among the best.
    _commit(manager, state, 6, {"acc": 0.95})
    assert ckpt.list_checkpoints(str(tmp_path)) == [3, 6]

    manager, state = _manager(
        tmp_path / "min", num_to_keep=1, checkpoint_score_order="min", checkpoint_score_attribute="val/loss"
    )
    for index, loss in enumerate([2.0, 1.0, 3.0]):
        _commit(manager, state, index, {"val": {"loss": loss}})
    assert ckpt.list_checkpoints(str(tmp_path / "min")) == [1, 2]  # best (lowest) + latest
    assert [_index(c) for c, _ in manager.best_checkpoints()] == [1]

    manager, state = _manager(tmp_path / "latest", num_to_keep=2)  # no score: the latest N
    for index in range(4):
        _commit(manager, state, index, {})
    assert ckpt.list_checkpoints(str(tmp_path / "latest")) == [2, 3]
    assert [_index(c) for c, _ in manager.best_checkpoints()] == [2, 3]


def test_missing_or_non_numeric_score_is_a_clear_error(tmp_path) -> None:
    manager, _ = _manager(tmp_path, checkpoint_score_attribute="acc")
    with pytest.raises(
        ConfigError,
        match=r"report 4 \(checkpoint_000004\) has no metric 'acc'; rank 0 reported \['epoch', 'loss'\]",
    ):
        manager.register(4, {"loss": 1.0, "epoch": 5})
    with pytest.raises(ConfigError, match="reported acc='high', which is not a number"):
        manager.register(4, {"acc": "high"})


def test_run_state_round_trip_keeps_the_ranking(tmp_path) -> None:
    manager, state = _manager(tmp_path, num_to_keep=1, checkpoint_score_attribute="acc")
    for index, acc in enumerate([0.3, 0.8, 0.2]):
        state.history[index] = {"acc": acc}
        _commit(manager, state, index, {"acc": acc})
    state.save(str(tmp_path))
    loaded = RunState(1)
    assert loaded.load(str(tmp_path)) and loaded.latest_ckpt == 2
    again = CheckpointManager(manager.config, str(tmp_path))
    again.restore(loaded)
    assert [_index(c) for c, _ in again.best_checkpoints()] == [1]
    assert sorted(i for i, _ in again.ordered()) == [1, 2]


def test_result_get_best_checkpoint() -> None:
    a, b, c = (Checkpoint(f"/r/checkpoint_00000{i}") for i in range(3))
    result = Result(None, c, best_checkpoints=[(a, {"acc": 0.2}), (b, {"acc": 0.9}), (c, {"loss": 1.0})])
    assert result.get_best_checkpoint("acc", "max") == b
    assert result.get_best_checkpoint("acc", "min") == a
    with pytest.raises(ValueError, match="no kept checkpoint reported a numeric 'f1'"):
        result.get_best_checkpoint("f1", "max")
    with pytest.raises(ValueError, match="mode='best'"):
        result.get_best_checkpoint("acc", "best")
    assert Result(None, None).get_best_checkpoint("acc", "max") is None


def _trainer(tmp_path, scores: list, **kwargs):
    from tpuray.train.torch import TorchTrainer

    config = kwargs.pop("checkpoint_config", None) or CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="score"
    )
    return TorchTrainer(
        _tracking_loops.scored_loop,
        train_loop_config={"scores": scores, **kwargs},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="best", checkpoint_config=config, verbose=0),
    )


def test_best_checkpoints_kept_on_disk_and_across_a_resumed_run(
    emulated_cluster, pg_leak_check, tmp_path
) -> None:
    run_dir = str(tmp_path / "best")
    result = _trainer(tmp_path, [3, 1, 5, 2]).fit()
    assert ckpt.list_checkpoints(run_dir) == [0, 2, 3]  # best two (5, 3) + the latest
    assert [(_index(c), m["score"]) for c, m in result.best_checkpoints] == [(0, 3), (2, 5)]
    assert _index(result.checkpoint) == 3
    with open(os.path.join(run_dir, "run_state.json")) as f:
        assert [r["index"] for r in json.load(f)["kept_checkpoints"]] == [3, 0, 2]

    # Same name, more epochs: resumes after checkpoint_000003 and keeps ranking checkpoint_000002 (5).
    result = _trainer(tmp_path, [3, 1, 5, 2, 4, 0]).fit()
    assert [m["epoch"] for m in result.metrics_history] == [1, 2, 3, 4, 5, 6]
    assert ckpt.list_checkpoints(run_dir) == [2, 4, 5]
    assert [(_index(c), m["score"]) for c, m in result.best_checkpoints] == [(4, 4), (2, 5)]
    assert result.best_checkpoints[-1][1]["val"] == {"score": 5}
    assert result.get_best_checkpoint("score", "max") == result.best_checkpoints[-1][0]
    with result.best_checkpoints[-1][0].as_directory() as d, open(os.path.join(d, "state.json")) as f:
        assert json.load(f) == {"epoch": 3}


def test_missing_score_attribute_fails_the_run(emulated_cluster, pg_leak_check, tmp_path) -> None:
    trainer = _trainer(tmp_path, [1, 2, 3], omit_score_at=2)
    with pytest.raises(
        ConfigError,
        match=r"checkpoint_score_attribute='score'\): report 1 \(checkpoint_000001\) has no metric 'score'; rank 0 reported \['epoch', 'note', 'val'\]",
    ):
        trainer.fit()
