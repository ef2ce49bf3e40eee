"""No hang when a slice goes at an awkward time, and nothing stale after it: a slice preempted while the
trainer starts its workers (the run resumes on the spare slice); a multi-slice run whose slice is
preempted with no spare (fit() waits for the node pool's replacement, and the new attempt's MEGASCALE_*
describe the new reservation); no slice at all after a preemption (fit() fails with a clear error once
$TPURAY_TRAIN_RESERVE_TIMEOUT_S is up). No timed assertions: each test only orders events."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray.cloudpickle

sys.path.insert(0, os.path.dirname(__file__))
import _loops  # noqa: E402

from _util import TWO_WORKERS_V6E_2X2  # noqa: E402
from tpuray.constants import RESERVE_TIMEOUT_ENV  # noqa: E402
from tpuray.slices.placement import SliceReservationTimeout  # noqa: E402
from tpuray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from tpuray.train.torch import TorchTrainer  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_loops)
# two workers of two chips per slice: what these tests order (reservation, loss, restart, MEGASCALE_*) does not
# depend on one process per chip
PER_SLICE = TWO_WORKERS_V6E_2X2["num_workers"]


def _trainer(tmp_path, name: str, config: dict, num_slices: int = 1, max_failures: int = 0) -> TorchTrainer:
    return TorchTrainer(
        _loops.preemptible_loop,
        train_loop_config={"step_s": 0.2, **config},
        scaling_config=ScalingConfig(
            **{**TWO_WORKERS_V6E_2X2, "num_workers": PER_SLICE * num_slices}, num_slices=num_slices
        ),
        run_config=RunConfig(
            storage_path=str(tmp_path),
            name=name,
            failure_config=FailureConfig(max_failures=max_failures),
            verbose=0,
        ),
    )


def _fit_while(trainer: TorchTrainer, target: Callable[[], str | None], strike: Callable[[str], Any]):
    """fit() while a thread waits for target() to name a node, then strikes it; returns (result or error,
    what strike returned)."""
    seen: dict = {}

    def watch() -> None:
        while not seen.get("stop"):
            node = target()
            if node is not None:
                seen["struck"] = strike(node)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        try:
            outcome: Any = trainer.fit()
        except Exception as e:  # noqa: BLE001 - returned to the test
            outcome = e
    finally:
        seen["stop"] = True
        thread.join()
    assert "struck" in seen, "the slice was never preempted"
    return outcome, seen["struck"]


def _marker(path) -> Callable[[], str | None]:
    return lambda: path.read_text() if path.exists() and path.read_text() else None


def _slice_of(cluster, node_id: str) -> str:
    return next(sl.name for sl in cluster.slices if node_id in sl.node_ids)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(
            "notice",
            marks=pytest.mark.full(
                "CI: the slice hard-killed while workers start ([hard-kill]), and a preemption notice "
                "mid-run resuming on the spare (train/test_preemption.py)"
            ),
        ),
        "hard-kill",
    ],
)
def test_slice_lost_while_workers_start_resumes_on_the_spare(
    emulated_cluster, pg_leak_check, tmp_path, how: str
) -> None:
    """The slice goes as soon as the run's worker placement group is placed, while its actors start (or
    set up the process group): drained with a 2 s notice (a preemption) or hard-killed (a failure). The
    attempt ends at once instead of waiting for workers Ray will not place there, and the run starts
    over on the spare slice."""
    from ray.util.placement_group import placement_group_table

    before = set(placement_group_table())

    def reserved() -> str | None:  # the run's worker placement group (a bundle per worker), once placed
        for pg_id, pg in placement_group_table().items():
            if pg_id not in before and pg["state"] == "CREATED" and len(pg["bundles"]) == PER_SLICE:
                return pg["bundles_to_node_id"][0]
        return None

    def strike(node_id: str) -> tuple[list[str], Callable[[], Any]]:  # (lost hosts, bring them back)
        if how == "notice":
            p = emulated_cluster.preempt_slice(_slice_of(emulated_cluster, node_id), notice_s=2)
            return p.node_ids, p.restore
        token = emulated_cluster.kill_host(node_id)
        return [node_id], lambda: emulated_cluster.restore_host(token)

    trainer = _trainer(tmp_path, how, {"steps": 6}, max_failures=1)
    result, (lost, bring_back) = _fit_while(trainer, reserved, strike)
    try:
        assert not isinstance(result, BaseException), result
        assert result.error is None
        assert (result.num_preemptions, result.num_failures) == ((1, 0) if how == "notice" else (0, 1))
        history = result.metrics_history
        assert [m["step"] for m in history] == list(range(1, 7))
        assert all(m["sum"] == PER_SLICE for m in history)  # a real all_reduce over the workers
        assert all(m["node_id"] not in lost for m in history)  # all on the spare slice
    finally:
        bring_back()  # the node pool brings the slice back


def test_multislice_run_waits_for_the_replacement_and_recomputes_megascale(
    emulated_cluster, pg_leak_check, tmp_path
) -> None:
    """Both slices in one run (MEGASCALE_NUM_SLICES=2), no spare: the slice of rank 0 (the coordinator's
    host) is preempted; fit() waits for the replacement, and every worker of the new attempt gets the
    MEGASCALE_* of the new reservation, none of the lost hosts'."""
    marker, env_dir = tmp_path / "marker", tmp_path / "env"
    env_dir.mkdir()
    config = {"steps": 10, "signal_at": 3, "marker": str(marker), "env_dir": str(env_dir)}
    trainer = _trainer(tmp_path, "multislice", config, num_slices=2)

    def preempt(node_id: str):  # the replacement comes back right after the kill, as a node pool's would
        return emulated_cluster.preempt_slice(
            _slice_of(emulated_cluster, node_id), notice_s=5, restore_after_s=0
        )

    result, preemption = _fit_while(trainer, _marker(marker), preempt)
    try:
        assert not isinstance(result, BaseException), result
        assert result.num_preemptions == 1 and result.num_failures == 0
        assert [m["step"] for m in result.metrics_history] == list(range(1, 11))
        world = 2 * PER_SLICE
        assert all(m["sum"] == world for m in result.metrics_history)  # all_reduce over both slices
        assert preemption.wait_restored(timeout_s=300)
        envs = {}
        for path in env_dir.glob("attempt*-rank*.json"):
            doc = json.loads(path.read_text())
            envs[doc["attempt"], doc["rank"]] = doc
        assert sorted(envs) == [(a, r) for a in (0, 1) for r in range(world)]
        for attempt in (0, 1):
            ranks = [envs[attempt, r] for r in range(world)]
            coordinator = f"{ranks[0]['node_ip']}:8081"  # rank 0's host, this attempt
            for doc in ranks:
                assert doc["MEGASCALE_COORDINATOR_ADDRESS"] == coordinator
                assert doc["MEGASCALE_PORT"] == "8081" and doc["MEGASCALE_NUM_SLICES"] == "2"
                assert doc["MEGASCALE_SLICE_ID"] == str(doc["rank"] // PER_SLICE)
            # one slice per MEGASCALE_SLICE_ID, the two different
            names = [{d["TPU_NAME"] for d in ranks[i * PER_SLICE : (i + 1) * PER_SLICE]} for i in (0, 1)]
            assert all(len(n) == 1 for n in names) and names[0] != names[1]
        lost = set(preemption.node_ids)
        assert envs[0, 0]["node_id"] in lost  # the coordinator's host was the one preempted...
        resumed = [envs[1, r] for r in range(world)]
        assert not {d["node_id"] for d in resumed} & lost  # ...and no worker of attempt 1 is on a lost host
        assert set(preemption.restored_node_ids) <= {d["node_id"] for d in resumed}  # but on its replacement
    finally:
        preemption.wait_restored(timeout_s=300)


def test_no_free_slice_after_a_preemption_fails_once_the_reservation_times_out(
    emulated_cluster, pg_leak_check, tmp_path, monkeypatch
) -> None:
    """Another job holds the spare slice and the preempted one never comes back: fit() waits up to
    $TPURAY_TRAIN_RESERVE_TIMEOUT_S for a slice, then fails with SliceReservationTimeout saying so; the
    checkpoint the loop made on the notice is kept. The first attempt reserves under a roomy timeout (its
    workers' start, on a loaded machine); the variable is read again for each attempt, and the one after
    the preemption can find no slice at all, so a short wait for it is waited out in full."""
    from tpuray.slices.placement import SlicePlacementGroup

    monkeypatch.setenv(RESERVE_TIMEOUT_ENV, "60")
    spare = SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60)
    marker = tmp_path / "marker"
    trainer = _trainer(tmp_path, "nospare", {"steps": 20, "signal_at": 3, "marker": str(marker)})

    def preempt(node_id: str):
        monkeypatch.setenv(RESERVE_TIMEOUT_ENV, "3")  # for the attempt after this preemption
        return emulated_cluster.preempt_slice(_slice_of(emulated_cluster, node_id), notice_s=5)

    try:
        error, preemption = _fit_while(trainer, _marker(marker), preempt)
    finally:
        spare.shutdown()
    try:
        assert isinstance(error, SliceReservationTimeout), error
        message = str(error)
        assert "attempt 1 after 1 preemption(s)" in message and "found no free slice within 3.0s" in message
        assert RESERVE_TIMEOUT_ENV in message and "checkpoint_" in message
        assert error.result.num_preemptions == 1
        assert error.result.checkpoint is not None  # the checkpoint asked for on the notice
        assert error.result.metrics_history[-1]["step"] >= 3
    finally:
        preemption.restore()


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "inf"])
def test_reserve_timeout_env_is_validated(monkeypatch, raw: str) -> None:
    from tpuray.train.worker import reserve_timeout_s
    from tpuray.validation import ConfigError

    monkeypatch.setenv(RESERVE_TIMEOUT_ENV, raw)
    with pytest.raises(ConfigError, match=f"{RESERVE_TIMEOUT_ENV}='{raw}' is invalid"):
        reserve_timeout_s()
