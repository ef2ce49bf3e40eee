"""RLRun placement on a real emulated cluster: colocated (one v6e 2x2 slice, the rollout engine inside the
trainer's two workers, sleeping while they train), a trainer worker killed mid-run, and the atomic
reservation of a disaggregated run whose second slice cannot be had (a rollout worker killed and
replaced: test_sync.py)."""

from __future__ import annotations

import re
import time

import _rl_loops  # noqa: E402
import pytest
import ray.cloudpickle

from tpuray.rl import RolloutConfig
from tpuray.rl.run import RLConfig, RLRun, RLRunError

ray.cloudpickle.register_pickle_by_value(_rl_loops)

from _rl_util import SCALING, latest_checkpoint, slice_rollout_config  # noqa: E402
from _rl_util import greedy as _greedy  # noqa: E402
from _rl_util import kill as _kill  # noqa: E402
from _rl_util import state_dict as _state_dict  # noqa: E402

from _util import alive_actors as _alive  # noqa: E402


def _no_group_left(pg_leak_check) -> None:
    assert not _alive("TrainWorker") and not _alive("RolloutWorker")
    pg_leak_check()  # ray.util.placement_group_table(): no live group beyond those before the test


def test_colocated_run_and_failures(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path, monkeypatch
):
    """Colocated: one slice, reserved by the trainer; the engine's TP ranks are the trainer's workers
    (HostedGroup), it generates batch k, sleeps (frees its weights and KV cache; sleep_level=2: the
    weights discarded, not copied to the host) while the trainer trains, takes update k+1 while asleep
    and wakes up with it. With trainer restarts, a killed trainer worker
    (the engine's rank too) restarts the trainer and the engine in the new workers, with the last update.
    A disaggregated run that cannot have both sides' slices at once (one is held elsewhere) starts
    nothing and holds nothing: the two are claimed in one request. Nothing is left."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from tpuray.rl.rollout.hosted import HostedGroup
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig

    # FSDP2 with FailureConfig(max_failures=1): rank 1 (a trainer worker and engine rank 1) is killed
    # while the engine generates batch 1, after checkpoint 0 (next iteration: 1) is committed. The
    # trainer restarts from it (attempt 1, at iteration 1, so nothing is re-sent); the next engine starts
    # in the new workers with update 1, whose objects the mailbox owns (both lost ranks staged them), and
    # generates batch 1 again
    colocated = RolloutConfig(tiny_models[0], max_model_len=64)
    calls: list = []

    def killing(engine, k: int) -> list:
        assert isinstance(engine.group, HostedGroup) and not engine.asleep
        calls.append((k, tuple(engine.group.actors)))
        # checkpoint k - 1 committed (its batches released first: the IterationStats below)
        while latest_checkpoint(f"file://{tmp_path}", "colocated") < k - 1:
            time.sleep(0.2)
        if k == 1 and len(calls) == 2:
            _kill(engine.group.actors[1])  # a trainer worker: the engine's next call fails
        return _greedy(engine)

    rl = RLRun(
        RLConfig(
            colocated,
            ScalingConfig(**SCALING),
            placement="colocated",
            weight_sync="object_store",
            sleep_level=2,  # the weights discarded while the trainer trains (its update replaces them)
        ),
        _rl_loops.restart_loop,
        train_loop_config={"path": tiny_models[1], "kill_at": -1, "strategy": "fsdp2"},
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}", name="colocated", failure_config=FailureConfig(max_failures=1)
        ),
    )
    result = rl.run(3, killing)
    assert [k for k, _ in calls] == [0, 1, 1, 2]  # batch 1 again, by the new engine
    assert calls[0][1] == calls[1][1] != calls[2][1] == calls[3][1]  # its workers are the new attempt's
    assert result.batches == [reference[w] for w in "abb"]  # on-policy: update k (asleep) before batch k
    assert result.versions == [1, 2, 3]  # update 1 reloaded (from the lost ranks' objects), not re-sent
    out = result.train_result.return_value  # rank 0 of the attempt that finished
    assert (out["attempt"], out["start"], out["seen"]) == (1, 1, result.batches[1:])
    full = sum(t.numel() * t.element_size() for t in _state_dict(tiny_models[0]).values())
    assert all(t.freed > full for t in result.times)  # both ranks' weight shards + KV caches
    assert [t.senders for t in result.times] == [2, 2, 2]
    # batches kept for a restart: those read since the last committed checkpoint (batch k-1, read after
    # report k-2, goes once checkpoint k-1 is committed); the last iteration's checkpoint may lag
    held = [t.batches_held for t in result.times]
    assert held[:2] == [1, 1] and held[2] in (1, 2), held
    _no_group_left(pg_leak_check)

    # disaggregated, one request: one slice is held elsewhere, so the two sides' slices (one each)
    # cannot be claimed at once in the trainer's 3 s; nothing starts, nothing is held
    disaggregated = slice_rollout_config(tiny_models[0], reservation_timeout_s=30)
    monkeypatch.setenv("TPURAY_TRAIN_RESERVE_TIMEOUT_S", "3")
    other = placement_group([{"TPU": 4, "TPU-v6e-4-head": 1}], name="someone-else")  # a whole slice
    ray.get(other.ready())
    try:
        with pytest.raises(
            RLRunError, match=r"could not reserve its slices at once: could not claim 2 x TPU-V6E 2x2 .*3.0s"
        ):
            RLRun(
                RLConfig(disaggregated, ScalingConfig(**SCALING)),
                _rl_loops.rl_loop,
                train_loop_config={"path": tiny_models[1], "strategy": "fsdp2"},
                run_config=RunConfig(storage_path=f"file://{tmp_path}", name="no-second-slice"),
            ).run(1, lambda engine, k: _greedy(engine))
        assert not _alive("RolloutWorker")  # no engine was started
    finally:
        remove_placement_group(other)
    _no_group_left(pg_leak_check)


@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp2",
        pytest.param(
            "ddp",
            marks=pytest.mark.full(
                "CI: the same over FSDP2 ([fsdp2]); tpu_dist's broadcast (runtime/test_dist.py)"
            ),
        ),
    ],
)
def test_colocated_hands_over_rank_shards_and_refuses_a_missing_tensor(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path, strategy
):
    """Colocated over the default weight_sync="tpu_dist" (the in-process hand-over): every rank takes
    each tensor whole over the trainer's group (FSDP2: its Shard(0) rows gathered, `full_tensor()`; DDP:
    rank 0's broadcast) and hands its engine rank its part in its own process; the engine, asleep at
    level 2, wakes up with them: batch 1 has the sent model's tokens. Update 2 misses a tensor: every
    rank refuses it before any collective, naming it, and the run ends with RLRunError. Nothing is
    left."""
    from tpuray.train import RunConfig, ScalingConfig

    batches: list = []

    def rollout(engine, k: int) -> list:
        batches.append(_greedy(engine))
        return batches[-1]

    rl = RLRun(
        RLConfig(
            RolloutConfig(tiny_models[0], max_model_len=64),
            ScalingConfig(**SCALING),
            placement="colocated",
            sleep_level=2,
        ),
        _rl_loops.rl_loop,
        train_loop_config={
            "path": tiny_models[1],
            "strategy": strategy,
            "drop": "model.norm.weight",
            "drop_at": 1,
        },
        run_config=RunConfig(storage_path=f"file://{tmp_path}", name=f"colocated-{strategy}"),
    )
    with pytest.raises(RLRunError, match=r"tensor 'model.norm.weight' .* is missing"):
        rl.run(3, rollout)
    assert batches == [reference[w] for w in "ab"]  # update 1 (model b) handed over, in place by batch 1
    _no_group_left(pg_leak_check)


@pytest.mark.full(
    "CI: a killed trainer worker restarts the trainer and its engine from the last update "
    "(test_colocated_run_and_failures)"
)
def test_trainer_worker_killed_restarts_from_its_checkpoint(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path
):
    """Disaggregated with FailureConfig(max_failures=1), over tpu_dist (the new attempt forms a new group
    with the engine's workers; the attempt-tagged updates and kept batches it checks are the same for
    "object_store", which passes this test too: one transport here, for the suite's time): a trainer
    worker killed
    (ray.kill) after sending update 2 and before checkpointing it restarts the trainer's worker group
    (tpuray.train's fault tolerance); the new attempt resumes from checkpoint 0 at iteration 1, takes
    batch 1 again and re-sends update 2, which the engine loads again over the lost attempt's, and the
    run completes every iteration. Nothing is left."""
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig

    rl = RLRun(
        RLConfig(slice_rollout_config(tiny_models[0]), ScalingConfig(**SCALING), weight_sync="tpu_dist"),
        _rl_loops.restart_loop,
        train_loop_config={"path": tiny_models[1], "kill_at": 1},
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}",
            name="restart",
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    result = rl.run(3, lambda engine, k: _greedy(engine))
    assert result.versions == [1, 2, 2, 3]  # the engine ends with the final version
    assert result.batches == [reference[w] for w in "abb"]  # generated with updates 0, 1, 2
    out = result.train_result.return_value  # rank 0 of the attempt that finished
    assert (out["attempt"], out["start"]) == (1, 1)  # restarted, resumed from its checkpoint
    assert out["seen"] == result.batches[1:]  # batch 1 handed again, then batch 2
    _no_group_left(pg_leak_check)


def _losing_run(tiny_models, tmp_path, weight_sync: str, max_failures: int) -> tuple[RLRun, object]:
    """An RLRun (disaggregated, overlap, DDP trainer: rank 0 sends the whole state) whose trainer rank 0
    ends its process once its update 2 is in the mailbox, while the driver still generates batch 2 (its
    rollout_fn waits for that), so the engine's load of update 2 finds it lost; (run, rollout_fn)."""
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig

    marker = tmp_path / "rank0-exited"

    def rollout(engine, k: int) -> list:
        if k == 2:  # while the trainer sends update 2: wait until its sender is gone
            for _ in range(1200):
                if marker.exists():
                    break
                time.sleep(0.25)
            assert marker.exists(), "trainer rank 0 did not end its process"
        return _greedy(engine)

    rl = RLRun(
        RLConfig(
            slice_rollout_config(tiny_models[0]),
            ScalingConfig(**SCALING),
            weight_sync=weight_sync,  # type: ignore[arg-type]
            overlap=True,
        ),
        _rl_loops.restart_loop,
        train_loop_config={"path": tiny_models[1], "lose_at": 1, "marker": str(marker)},
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}",
            name=f"lost-update-{weight_sync}",
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return rl, rollout


def test_update_lost_with_its_sender_ends_a_run_without_trainer_restarts(
    emulated_cluster, pg_leak_check, tiny_models, tmp_path
):
    """Over tpu_dist without trainer restarts: trainer rank 0 dies holding the update 2 it offered (the
    receivers had not asked for the data yet), so the rollout ranks' receive fails at once ("Connection
    closed by peer": TransferError, UpdateLostError on the driver), before the trainer run's own failure
    is seen; nothing would send the update again, so the run ends with an RLRunError naming the lost
    update and the FailureConfig that would have it re-sent. Nothing is left."""
    rl, rollout = _losing_run(tiny_models, tmp_path, "tpu_dist", max_failures=0)
    with pytest.raises(
        RLRunError,
        match=r"update 2 was lost with a trainer rank before the engine loaded it \(the update's pieces were "
        r"lost .*TransferError: .*trainer rank 0 did not arrive whole over tpu_dist.*FailureConfig\(max_failures=N\)",
    ):
        rl.run(3, rollout)
    _no_group_left(pg_leak_check)


@pytest.mark.full(
    "CI: a lost update's UpdateLostError on the slice engine (rl/rollout/test_rollout_engine.py), a trainer restart in an RLRun (test_trainer_worker_killed_restarts_from_its_checkpoint), a lost update without restarts (test_update_lost_with_its_sender_ends_a_run_without_trainer_restarts)"
)
@pytest.mark.parametrize("weight_sync", ["object_store", "tpu_dist"])
def test_update_lost_with_its_sender_is_sent_again_by_the_restarted_trainer(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path, caplog, weight_sync
):
    """Disaggregated with overlap and FailureConfig(max_failures=1), over each transport (`_losing_run`):
    trainer rank 0 (DDP: it sends the whole state; its process owns the objects, or holds the buffer it
    offered over tpu_dist until a receiver asks for it) dies once its update 2 is in the mailbox, so the
    engine's load of update 2 finds the objects lost, or the connection to the sender broken
    (UpdateLostError). The engine keeps update 1 and is not replaced; the restarted trainer resumes
    from checkpoint 0 at iteration 1 and sends update 2 again, which the engine loads (versions 1, 2, 3:
    the lost update is not counted). Nothing is left."""
    rl, rollout = _losing_run(tiny_models, tmp_path, weight_sync, max_failures=1)
    with caplog.at_level("WARNING", logger="tpuray.rl"):
        result = rl.run(3, rollout)
    assert "update 2 (trainer attempt 0) was lost with a trainer rank" in caplog.text
    assert result.versions == [1, 2, 3] and result.rollout_restarts == 0  # update 2 once: the re-sent one
    assert result.batches == [reference[w] for w in "aab"]  # overlap: batch k+1 with update k
    out = result.train_result.return_value
    assert (out["attempt"], out["start"]) == (1, 1)  # restarted, resumed from its checkpoint
    _no_group_left(pg_leak_check)


def _host_lost_run(
    cluster, tiny_models, tmp_path, name: str, resend: bool, weight_sync: str
) -> tuple[object, list]:
    """A colocated RLRun (FSDP2, FailureConfig(max_failures=1)) whose slice's host is killed while the
    engine generates batch 1 (checkpoint 0 committed), taking the trainer's workers, the engine and
    update 1 (the pieces the mailbox had taken from them over "object_store", the shards handed over in
    their processes over "tpu_dist"); `resend`: the train loop sends its restored weights before its
    first `rl.batch`. (its result or RLRunError, rollout_fn's calls)."""
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig

    calls: list = []
    lost: list = []

    def losing_the_host(engine, k: int) -> list:
        calls.append((k, tuple(engine.group.actors)))
        if k == 1 and len(calls) == 2:
            while latest_checkpoint(f"file://{tmp_path}", name) != 0:
                time.sleep(0.2)
            actor = engine.group.actors[0]
            node = ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
            lost.append(cluster.kill_host(node))
        return _greedy(engine)

    rl = RLRun(
        RLConfig(
            RolloutConfig(tiny_models[0], max_model_len=64),
            ScalingConfig(**SCALING),
            placement="colocated",
            weight_sync=weight_sync,  # type: ignore[arg-type]
        ),
        _rl_loops.restart_loop,
        train_loop_config={"path": tiny_models[1], "strategy": "fsdp2", "resend": resend},
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}", name=name, failure_config=FailureConfig(max_failures=1)
        ),
    )
    try:
        try:
            return rl.run(3, losing_the_host), calls
        except RLRunError as e:
            return e, calls
    finally:
        for token in lost:
            cluster.restore_host(token)


@pytest.mark.full(
    "CI: an update lost with its sender ends a run with what to do "
    "(test_update_lost_with_its_sender_ends_a_run_without_trainer_restarts), and a colocated restart in "
    "new workers (test_colocated_run_and_failures)"
)
@pytest.mark.parametrize("weight_sync", ["object_store", "tpu_dist"])
def test_colocated_host_lost_without_resent_weights_ends_saying_what_to_do(
    emulated_cluster, pg_leak_check, tiny_models, tmp_path, weight_sync
):
    """A colocated run's host lost (`_host_lost_run`) with a train loop that does not send its restored
    weights: the engine started in the restarted attempt's workers (on the other slice) cannot load update
    1 (its pieces were in the lost host's object store, or its shards in the lost processes), and the run
    ends with an RLRunError saying what to do. Nothing is left."""
    error, calls = _host_lost_run(
        emulated_cluster,
        tiny_models,
        tmp_path,
        f"host-lost-{weight_sync}",
        resend=False,
        weight_sync=weight_sync,
    )
    assert isinstance(error, RLRunError), error
    assert re.search(
        r"cannot load update 1, whose pieces were lost with the worker or host.*send its restored weights before "
        r"its first rl.batch",
        str(error),
        re.DOTALL,
    ), error
    assert [k for k, _ in calls] == [0, 1]
    _no_group_left(pg_leak_check)


@pytest.mark.full(
    "CI: the in-process hand-over of an FSDP2 run "
    "(test_colocated_hands_over_rank_shards_and_refuses_a_missing_tensor[fsdp2]), a colocated restart in new "
    "workers (test_colocated_run_and_failures), an update lost with its sender "
    "(test_update_lost_with_its_sender_ends_a_run_without_trainer_restarts)"
)
def test_colocated_host_lost_restarts_on_the_other_slice_with_the_resent_weights(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path
):
    """A colocated run's host lost (`_host_lost_run`) with a train loop that sends its restored weights
    (`rl.send(model, version=start)` before its first `rl.batch`): the engine started in the restarted
    attempt's workers (on the other slice) loads the re-sent update 1, generates batch 1 again and the
    run completes. Over "tpu_dist" (the default), whose in-process hand-over (FSDP2's rows gathered over
    the trainer's group, each rank's shards left for the engine rank in its process) gives every
    update's tokens. Nothing is left."""
    result, calls = _host_lost_run(
        emulated_cluster, tiny_models, tmp_path, "host-lost-resend", resend=True, weight_sync="tpu_dist"
    )
    assert not isinstance(result, BaseException), result
    assert [k for k, _ in calls] == [0, 1, 1, 2]  # batch 1 again, by the new engine
    assert calls[1][1] != calls[2][1]  # in the restarted attempt's workers
    assert result.versions == [1, 1, 2, 3]  # update 1 re-sent by the restarted attempt
    assert result.batches == [reference[w] for w in "abb"]
    out = result.train_result.return_value
    assert (out["attempt"], out["start"], out["seen"]) == (1, 1, result.batches[1:])
    _no_group_left(pg_leak_check)
