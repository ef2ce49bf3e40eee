"""The trainer side of an `RLRun`: `tpuray.train`'s `TorchTrainer.fit()` in a driver thread, with an explicit
lifecycle: `start` (the thread), `alive` (RLRunError once the run ended early, called while the driver
waits on the mailbox), `result` (the run's `Result`, once the loop sent every update) and `stop` (after a
failure: the mailbox closed, so the ranks' next call fails and fit() ends; bounded wait)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from tpuray.rl.result import RLRunError
from tpuray.rl.sync.driver import WeightSync
from tpuray.rl.sync.trainer import SyncTarget
from tpuray.train.callbacks import Callback

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 120.0  # for the trainer's workers to end once the run failed


class _ReleaseBatches(Callback):
    """On the driver: once a checkpoint is committed, the mailbox drops the batches a trainer restarting
    from it cannot ask for again (`Mailbox.release_batches`), so a long run holds only the batches read
    since its last checkpoint."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox = mailbox

    def on_report(self, metrics: dict[str, Any], checkpoint: Any, *, index: int) -> None:
        import ray

        if checkpoint is None:
            return
        try:  # awaited: done before tpuray.train records the checkpoint as the run's latest
            released = ray.get(self.mailbox.release_batches.remote(index))
        except ray.exceptions.RayActorError:  # the mailbox is gone: the run is ending, nothing to keep
            return
        logger.debug("tpuray.rl: checkpoint %d committed; %d batch(es) released", index, released)


class TrainerSide:
    """`train_loop` under `tpuray.train` (its config's "rl" key: the `SyncTarget`) in a driver thread."""

    def __init__(
        self,
        train_loop: Callable[[dict], Any],
        train_loop_config: dict,
        scaling_config: Any,
        run_config: Any,
    ) -> None:
        self.train_loop = train_loop
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config
        self.run_config = run_config
        self._out: dict[str, Any] = {}  # fit()'s "result" or "error"
        self._thread: threading.Thread | None = None

    @property
    def restarts(self) -> bool:
        """Whether the trainer may restart after a lost worker (FailureConfig(max_failures) != 0)."""
        return self.run_config.failure_config.max_failures != 0

    def start(self, target: SyncTarget) -> None:
        from tpuray.train.torch import TorchTrainer

        callbacks = [*(self.run_config.callbacks or []), _ReleaseBatches(target.mailbox)]
        trainer = TorchTrainer(
            self.train_loop,
            train_loop_config={**self.train_loop_config, "rl": target},
            scaling_config=self.scaling_config,
            run_config=dataclasses.replace(self.run_config, callbacks=callbacks),
        )
        out = self._out = {}

        def fit() -> None:
            try:
                out["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - raised on the driver's thread by alive()
                out["error"] = e

        self._thread = threading.Thread(target=fit, name="tpuray-rl-trainer", daemon=True)
        self._thread.start()

    def alive(self) -> None:
        """Raise RLRunError when the trainer run ended (it should be waiting on the mailbox)."""
        assert self._thread is not None
        if self._thread.is_alive():
            return
        error = self._out.get("error")
        if error is not None:
            raise RLRunError(
                f"the RL run ended: the trainer failed ({type(error).__name__}: {error})"
            ) from error
        raise RLRunError("the RL run ended: the trainer's loop returned before sending all its updates")

    def result(self) -> Any:
        """The trainer run's Result, once fit() returned (RLRunError where it failed)."""
        assert self._thread is not None
        self._thread.join()
        if "result" not in self._out:
            self.alive()
        return self._out["result"]

    def stop(self, sync: WeightSync) -> None:
        """End the trainer run: its ranks' next mailbox call fails (SyncError), fit() fails and releases
        its slice; wait for that (bounded)."""
        sync.shutdown()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.error(
                    "tpuray.rl: the trainer run did not end within %ss of the failure", STOP_TIMEOUT_S
                )
