"""RunConfig(callbacks=[...]) on the driver: on_start / on_report / on_checkpoint / on_restart / on_end in
order, MLflow and TensorBoard loggers read back with their own readers, and failures surfaced by name."""

from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402
import _tracking_loops  # noqa: E402

from _util import alive_actors, read_ranks  # noqa: E402
from tpuray.optional import MissingDependency  # noqa: E402
from tpuray.train import (  # noqa: E402
    Callback,
    CallbackError,
    CheckpointConfig,
    FailureConfig,
    MLflowLoggerCallback,
    RunConfig,
    ScalingConfig,
    TensorBoardLoggerCallback,
    TrainingFailedError,
)
from tpuray.train.callbacks.hooks import RunHooks  # noqa: E402
from tpuray.train.checkpoint.manager import RunState  # noqa: E402
from tpuray.train.session import ReportRecord  # noqa: E402
from tpuray.validation import ConfigError  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)
ray.cloudpickle.register_pickle_by_value(_tracking_loops)

TPU_2x2 = dict(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E")


class Recorder(Callback):
    """Records every hook call as a tuple."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.result = None

    def on_start(self, run) -> None:
        self.events.append(("start", run.name, run.run_path))

    def on_report(self, metrics, checkpoint, *, index: int) -> None:
        self.events.append(("report", index, metrics.get("epoch"), checkpoint is not None))

    def on_checkpoint(self, checkpoint, metrics) -> None:
        self.events.append(("checkpoint", os.path.basename(checkpoint.path), metrics.get("epoch")))

    def on_restart(self, attempt: int, error: BaseException) -> None:
        self.events.append(("restart", attempt, str(error)))

    def on_end(self, result) -> None:
        self.result = result
        self.events.append(("end", result.error))


class Boom(Callback):
    def on_report(self, metrics, checkpoint, *, index: int) -> None:
        if index == 1:
            raise RuntimeError("the dashboard is down")


def _expected(epochs: int, start: int = 0) -> list[tuple]:
    out: list[tuple] = []
    for i in range(start, epochs):
        out += [("report", i, i + 1, True), ("checkpoint", f"checkpoint_{i:06d}", i + 1)]
    return out


def _tb_scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


# -- construction -------------------------------------------------------------------------------------
def test_bad_callbacks_are_refused_at_construction(tmp_path, monkeypatch) -> None:
    assert RunConfig().callbacks == [] and RunConfig(callbacks=(Recorder(),)).callbacks[0].events == []
    with pytest.raises(ConfigError, match=r"RunConfig.callbacks\[1\]=<object object at .*> is invalid"):
        RunConfig(callbacks=[Recorder(), object()])
    with pytest.raises(
        ConfigError, match=r"RunConfig.callbacks\[0\]=.*Recorder'> is a class: pass an instance"
    ):
        RunConfig(callbacks=[Recorder])
    with pytest.raises(ConfigError, match="RunConfig.callbacks=.* is invalid: use a list"):
        RunConfig(callbacks=Recorder())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"MLflowLoggerCallback.tags=\['a'\] is invalid"):
        MLflowLoggerCallback(str(tmp_path), tags=["a"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="MLflowLoggerCallback.experiment_name='' is invalid"):
        MLflowLoggerCallback(str(tmp_path), experiment_name="")
    with pytest.raises(ConfigError, match="MLflowLoggerCallback.save_artifact='yes' is invalid"):
        MLflowLoggerCallback(str(tmp_path), save_artifact="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="TensorBoardLoggerCallback.log_dir='s3://bucket/tb' is invalid"):
        TensorBoardLoggerCallback("s3://bucket/tb")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert MLflowLoggerCallback(str(tmp_path)).tracking_uri == f"file://{tmp_path}"
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # MLflow 3 refuses file stores without it

    # Missing packages fail at construction with the pip command (as if not installed: None in sys.modules).
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(
        MissingDependency, match=r"tracking_uri='sqlite:///x.db'\) needs the 'sqlalchemy' package"
    ):
        MLflowLoggerCallback("sqlite:///x.db")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(
        MissingDependency, match=r"pip install 'tpuray\[tracking\]' \(or pip install mlflow-skinny\)"
    ):
        MLflowLoggerCallback()
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(
        MissingDependency, match=r"TensorBoardLoggerCallback needs the 'tensorboardX' package"
    ):
        TensorBoardLoggerCallback()


def test_reports_are_delivered_once_every_rank_made_them() -> None:
    """on_report waits for the slowest rank (as Ray's after_report), in report order, exactly once."""
    rec = Recorder()
    hooks = RunHooks([rec], "/nowhere")
    state = RunState(world_size=2)
    registered: list[int] = []
    register = lambda i, m: registered.append(i)  # noqa: E731
    metrics = lambda i: {"epoch": i + 1}  # noqa: E731
    state.add(0, [ReportRecord(i, metrics(i), i == 1) for i in range(3)], lambda m: None)
    state.add(1, [ReportRecord(0, None, False)], lambda m: None)
    state.commit()
    hooks.after_collect(state, register)
    assert rec.events == [("report", 0, 1, False)]  # rank 1 has not made report 1 yet
    state.add(1, [ReportRecord(1, None, False), ReportRecord(2, None, False)], lambda m: None)
    state.commit()
    hooks.after_collect(state, register)
    hooks.after_collect(state, register)
    assert registered == [1]  # the committed checkpoint, registered (for retention) once
    assert rec.events[1:] == [
        ("report", 1, 2, True),
        ("checkpoint", "checkpoint_000001", 2),
        ("report", 2, 3, False),
    ]


# -- real runs ----------------------------------------------------------------------------------------
def test_callbacks_and_loggers_on_cpu_workers(emulated_cluster, pg_leak_check, tmp_path) -> None:
    from tpuray.train.torch import TorchTrainer

    rec, uri = Recorder(), f"file://{tmp_path}/mlruns"
    mlflow_cb = MLflowLoggerCallback(uri, tags={"team": "tpu"}, save_artifact=True)
    tb = TensorBoardLoggerCallback()
    trainer = TorchTrainer(
        _tracking_loops.scored_loop,
        train_loop_config={"scores": [0.5, 0.25, 0.75], "lr": 0.1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path / "results"), name="cb", callbacks=[rec, mlflow_cb, tb], verbose=0
        ),
    )
    result = trainer.fit()
    run_path = str(tmp_path / "results" / "cb")
    assert rec.events == [("start", "cb", run_path), *_expected(3), ("end", None)]
    assert rec.result is not None and rec.result.metrics_history == result.metrics_history

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(mlflow_cb.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "cb"
    assert client.get_experiment(run.info.experiment_id).name == "cb"  # default: the run name
    assert run.data.tags["team"] == "tpu" and run.data.tags["tpuray.run_path"] == run_path
    assert run.data.params == {"lr": "0.1"}  # scalar train_loop_config values ("scores" is a list)
    assert _mlflow_history(uri, mlflow_cb.run_id, "score") == [(0, 0.5), (1, 0.25), (2, 0.75)]
    assert _mlflow_history(uri, mlflow_cb.run_id, "val/score") == [(0, 0.5), (1, 0.25), (2, 0.75)]
    assert "note" not in run.data.metrics  # non-numeric: skipped
    artifacts = {a.path for a in client.list_artifacts(mlflow_cb.run_id)}
    assert {"run_state.json", "checkpoint_000002", "tensorboard"} <= artifacts

    assert tb.writer_dir == os.path.join(run_path, "tensorboard")
    assert _tb_scalars(tb.writer_dir, "epoch") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert _tb_scalars(tb.writer_dir, "val/score") == [(0, 0.5), (1, 0.25), (2, 0.75)]


class MarkerRecorder(Recorder):
    """Also writes `marker` once report `index` reached the driver (the crashing loop waits for it)."""

    def __init__(self, marker: str, index: int) -> None:
        super().__init__()
        self.marker, self.index = marker, index

    def on_report(self, metrics, checkpoint, *, index: int) -> None:
        super().on_report(metrics, checkpoint, index=index)
        if index == self.index:
            open(self.marker, "w").close()


def test_on_restart_after_a_worker_crash(emulated_cluster, pg_leak_check, tmp_path) -> None:
    from tpuray.train.torch import TorchTrainer

    rec = MarkerRecorder(str(tmp_path / "marker"), 2)
    uri, tb = f"file://{tmp_path}/mlruns", TensorBoardLoggerCallback(tmp_path / "tb")
    mlflow_cb = MLflowLoggerCallback(uri)
    trainer = TorchTrainer(
        _tracking_loops.crash_once_loop,
        train_loop_config={"epochs": 4, "crash_after": 2, "marker": rec.marker},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path),
            name="crash",
            failure_config=FailureConfig(max_failures=1),
            callbacks=[rec, tb, mlflow_cb],
            verbose=0,
        ),
    )
    result = trainer.fit()
    assert result.num_failures == 1 and [m["attempt"] for m in result.metrics_history] == [0, 0, 1, 1]
    at = [e[0] for e in rec.events].index("restart")
    assert rec.events[at][1] == 1 and "died" in rec.events[at][2]
    # Report 2 (no checkpoint) was delivered, then rank 1 died: the run resumes after checkpoint_000001
    # and makes report 2 again.
    assert rec.events[1:at] == [*_expected(2), ("report", 2, 3, False)]
    assert rec.events[at + 1 :] == [("report", 2, 3, False), *_expected(4, start=3), ("end", None)]
    # TensorBoard: the re-made report replaces the first one (purge_step); MLflow keeps both values.
    assert _tb_scalars(str(tmp_path / "tb"), "attempt") == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]
    assert sorted(_mlflow_history(uri, mlflow_cb.run_id, "attempt")) == [
        (0, 0),
        (1, 0),
        (2, 0),
        (2, 1),
        (3, 1),
    ]
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).get_run(mlflow_cb.run_id).data.tags["tpuray.attempt"] == "1"


def test_a_raising_callback_fails_the_run_by_name(emulated_cluster, pg_leak_check, tmp_path) -> None:
    from tpuray.train.torch import TorchTrainer

    rec, uri = Recorder(), f"file://{tmp_path}/mlruns"
    mlflow_cb = MLflowLoggerCallback(uri, experiment_name="failing")
    trainer = TorchTrainer(
        _tracking_loops.scored_loop,
        train_loop_config={"scores": [1, 2, 3]},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path), name="boom", callbacks=[rec, Boom(), mlflow_cb], verbose=0
        ),
    )
    with pytest.raises(
        CallbackError, match="callback Boom.on_report raised RuntimeError: the dashboard is down"
    ) as info:
        trainer.fit()
    err = info.value
    assert isinstance(err, TrainingFailedError) and isinstance(err.__cause__, RuntimeError)
    assert err.result is not None and err.result.error is err
    assert rec.events[-1] == ("end", err)  # every started callback still sees the end
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).get_run(mlflow_cb.run_id).info.status == "FAILED"


def test_seed_loop_with_callbacks_on_emulated_tpu_2x2(emulated_cluster, pg_leak_check, tmp_path) -> None:
    """The seed loop on an emulated v6e 2x2 slice (4 workers over tpu_dist): each rank's environment, a
    falling loss, the best two checkpoints by loss kept on disk, and the callbacks (a recorder, MLflow,
    TensorBoard) seeing every report and checkpoint of that fit."""
    import json

    import torch

    from tpuray.train.torch import TorchTrainer

    out = tmp_path / "env"
    out.mkdir()
    rec, uri, tb = Recorder(), f"file://{tmp_path}/mlruns", TensorBoardLoggerCallback()
    mlflow_cb = MLflowLoggerCallback(uri)
    trainer = TorchTrainer(
        _loops.seed_loop,
        train_loop_config={"out_dir": str(out), "checkpoint": True, "epochs": 6},
        scaling_config=ScalingConfig(resources_per_worker={"TPU": 1}, **TPU_2x2),
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}/results",
            name="seed",
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"
            ),
            callbacks=[rec, mlflow_cb, tb],
            verbose=0,
        ),
    )
    result = trainer.fit()

    losses = [m["loss"] for m in result.metrics_history]
    assert [m["epoch"] for m in result.metrics_history] == list(range(1, 7))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert result.metrics == result.metrics_history[-1] and result.error is None
    assert result.return_value == "finished"

    ranks = read_ranks(out)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["RANK"] == str(r["rank"]) and r["WORLD_SIZE"] == "4" and r["world"] == 4
        assert (
            r["LOCAL_RANK"] == r["TPU_VISIBLE_CHIPS"] == str(r["local"])
        )  # TorchTPU binds it from LOCAL_RANK
        assert r["LOCAL_WORLD_SIZE"] == "4" and r["NODE_RANK"] == "0" and r["node"] == 0
        assert r["TORCH_TPU_TOPOLOGY"] and r["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
        assert r["TPURAY_EMULATION"] == "1" and r["device"] == "tpu"
        assert r["model"] == "DistributedDataParallel"
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1
    assert len({r["TORCH_TPU_SLICEBUILDER_ADDRESSES"] for r in ranks}) == 1

    # Checkpoints: persisted under storage/name, the best two by loss kept (the loss falls: the newest
    # two), the result points at the last.
    run_dir = tmp_path / "results" / "seed"
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_000004", "checkpoint_000005"]
    assert result.checkpoint.path.endswith("checkpoint_000005") and result.path.endswith("seed")
    with result.checkpoint.as_directory() as d:
        assert torch.load(os.path.join(d, "state.pt"))["epoch"] == 6
    assert json.load(open(run_dir / "run_state.json"))["finished"] is True
    best = sorted(range(6), key=lambda i: losses[i])[:2]
    assert sorted(c.path.rsplit("/", 1)[-1] for c, _ in result.best_checkpoints) == sorted(
        f"checkpoint_{i:06d}" for i in best
    )
    assert not alive_actors("TrainWorker")

    # Callbacks: every report and checkpoint in order; MLflow and TensorBoard have every loss.
    assert rec.events[1:] == [*_expected(6), ("end", None)]
    assert _mlflow_history(uri, mlflow_cb.run_id, "loss") == list(enumerate(losses))
    assert _tb_scalars(tb.writer_dir, "loss") == [(i, pytest.approx(v)) for i, v in enumerate(losses)]
