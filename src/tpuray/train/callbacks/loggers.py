"""Experiment tracking callbacks: MLflow and TensorBoard (`pip install 'tpuray[tracking]'`).

Both log rank 0's numeric metrics of every report with step = the report index (0, 1, 2, ...; nested
dicts flattened with "/"); other values are skipped (logged at debug level). A missing package raises
`tpuray.optional.MissingDependency` when the callback is constructed, never mid-run.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tpuray.constants import MLFLOW_ALLOW_FILE_STORE_ENV
from tpuray.optional import require
from tpuray.train import checkpoint as ckpt
from tpuray.train.callbacks import Callback, RunInfo, numeric_metrics
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.result import Result

logger = logging.getLogger("tpuray.train")

MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call
MLFLOW_PARAM_BATCH = 100  # ... and of params
MLFLOW_PARAM_CHARS = 500
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _check_path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{name}={value!r} is invalid: use a path, a URI or None.")
    return os.fspath(value)


def _scalar_params(config: dict[str, Any] | None, prefix: str = "") -> dict[str, str]:
    """train_loop_config's scalar values as MLflow params (nested dicts flattened with "/")."""
    out: dict[str, str] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_scalar_params(value, f"{name}/"))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = str(value)[:MLFLOW_PARAM_CHARS]
        else:
            logger.debug("MLflowLoggerCallback: train_loop_config[%r] is not a scalar; not logged", name)
    return out


class MLflowLoggerCallback(Callback):
    """Log each report's numeric metrics to an MLflow run (step = report index), as Ray's
    `ray.air.integrations.mlflow.MLflowLoggerCallback`.

    tracking_uri: an MLflow tracking URI (http(s)://server, sqlite:///path.db, databricks, ...) or a local
    directory / file:// URI (MLflow's file store; tpuray sets MLFLOW_ALLOW_FILE_STORE=true for it when
    unset, since MLflow 3 refuses file stores otherwise). None: MLflow's own default
    ($MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory).
    experiment_name: default the run name (RunConfig.name). tags: set on the MLflow run (plus
    tpuray.run_path). save_artifact: at the end, upload the run directory (checkpoints kept,
    run_state.json, ...) as the MLflow run's artifacts. train_loop_config's scalar values are logged as
    params. One MLflow run per fit(); restarts continue it (the tag tpuray.attempt counts them).
    """

    def __init__(
        self,
        tracking_uri: str | os.PathLike | None = None,
        *,
        experiment_name: str | None = None,
        tags: dict[str, Any] | None = None,
        save_artifact: bool = False,
    ) -> None:
        uri = _check_path("MLflowLoggerCallback.tracking_uri", tracking_uri)
        if experiment_name is not None and (not isinstance(experiment_name, str) or not experiment_name):
            raise ConfigError(
                f"MLflowLoggerCallback.experiment_name={experiment_name!r} is invalid: use a non-empty "
                "name, or None for the run name."
            )
        if tags is not None and (not isinstance(tags, dict) or not all(isinstance(k, str) for k in tags)):
            raise ConfigError(f"MLflowLoggerCallback.tags={tags!r} is invalid: use a dict with str keys.")
        if not isinstance(save_artifact, bool):
            raise ConfigError(f"MLflowLoggerCallback.save_artifact={save_artifact!r} is invalid: use a bool.")
        self._mlflow = require("mlflow", "tracking", "MLflowLoggerCallback", "mlflow-skinny")
        self.tracking_uri = self._resolve(uri)
        self.experiment_name = experiment_name
        self.tags = {k: str(v) for k, v in (tags or {}).items()}
        self.save_artifact = save_artifact
        self.run_id: str | None = None  # the MLflow run of the current/last fit()
        self.experiment_id: str | None = None
        self._client: Any = None

    def _resolve(self, uri: str | None) -> str:
        if uri is None:
            uri = str(self._mlflow.get_tracking_uri())
        scheme = urlparse(uri).scheme
        if scheme == "" and uri != "databricks":  # a directory: MLflow's file store
            uri = "file://" + os.path.abspath(os.path.expanduser(uri))
            scheme = "file"
        if scheme == "file":
            if MLFLOW_ALLOW_FILE_STORE_ENV not in os.environ:  # honoured by MLflow 3, ignored by older ones
                os.environ[MLFLOW_ALLOW_FILE_STORE_ENV] = "true"
                logger.debug(
                    "MLflowLoggerCallback: %s=true for the file store %s", MLFLOW_ALLOW_FILE_STORE_ENV, uri
                )
        elif scheme.split("+")[0] in SQL_SCHEMES:  # MLflow's SQL store (mlflow-skinny lacks its deps)
            feature = f"MLflowLoggerCallback(tracking_uri={uri!r})"
            require("sqlalchemy", "tracking", feature, "sqlalchemy")
            require("alembic", "tracking", feature, "alembic")
        return uri

    def on_start(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment_name or run.name
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = str(experiment.experiment_id)
        else:
            try:
                experiment_id = client.create_experiment(name)
            except MlflowException:  # created meanwhile by a concurrent run
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
                experiment_id = str(experiment.experiment_id)
        self.experiment_id = experiment_id
        tags = {**self.tags, "tpuray.run_path": run.run_path, "tpuray.attempt": "0"}
        self.run_id = client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
        params = [Param(k, v) for k, v in _scalar_params(run.train_loop_config).items()]
        for i in range(0, len(params), MLFLOW_PARAM_BATCH):
            client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAM_BATCH])

    def on_report(self, metrics: dict[str, Any], checkpoint: ckpt.Checkpoint | None, *, index: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, index) for k, v in numeric_metrics(metrics).items()]
        for i in range(0, len(batch), MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + MLFLOW_BATCH])

    def on_restart(self, attempt: int, error: BaseException) -> None:
        self._client.set_tag(self.run_id, "tpuray.attempt", str(attempt))

    def on_end(self, result: Result) -> None:
        if self.save_artifact and result.path:
            with ckpt.Checkpoint(result.path).as_directory() as run_dir:
                self._client.log_artifacts(self.run_id, run_dir)
        if result.error is None:
            status = "FINISHED"
        elif isinstance(result.error, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        self._client.set_terminated(self.run_id, status)


class TensorBoardLoggerCallback(Callback):
    """Write each report's numeric metrics as TensorBoard scalars (step = report index) with tensorboardX.

    log_dir: a local directory or file:// URI; None: `<run_path>/tensorboard` (then the run's storage
    must be local). After a restart, the reports re-made past the resumed checkpoint replace the earlier
    ones (a new event file with purge_step, which TensorBoard honours). View with
    `tensorboard --logdir <log_dir>`.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None) -> None:
        path = _check_path("TensorBoardLoggerCallback.log_dir", log_dir)
        if path is not None and not ckpt.is_local(path):
            raise ConfigError(
                f"TensorBoardLoggerCallback.log_dir={path!r} is invalid: TensorBoard event files are written "
                "on the driver; use a local directory or a file:// URI."
            )
        self._tbx = require("tensorboardX", "tracking", "TensorBoardLoggerCallback")
        self.log_dir = path
        self.writer_dir: str | None = None  # where the current/last fit() writes
        self._writer: Any = None
        self._last: int | None = None

    def on_start(self, run: RunInfo) -> None:
        where = self.log_dir or ckpt.join(run.run_path, "tensorboard")
        if not ckpt.is_local(where):
            raise ConfigError(
                f"TensorBoardLoggerCallback: the run path {run.run_path!r} is not local, so the default "
                "log_dir (<run_path>/tensorboard) cannot be written; pass log_dir=<local directory>."
            )
        self.writer_dir = os.path.abspath(os.path.expanduser(ckpt.local_path(where)))
        os.makedirs(self.writer_dir, exist_ok=True)
        self._writer, self._last = None, None

    def on_report(self, metrics: dict[str, Any], checkpoint: ckpt.Checkpoint | None, *, index: int) -> None:
        scalars = numeric_metrics(metrics)
        if not scalars:
            return
        if self._writer is None or (self._last is not None and index <= self._last):
            self._close()  # first report, or re-made after a restart: steps >= index are superseded
            self._writer = self._tbx.SummaryWriter(logdir=self.writer_dir, purge_step=index, flush_secs=30)
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=index)
        self._writer.flush()
        self._last = index

    def on_end(self, result: Result) -> None:
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
