"""Weight sync from a real `tpuray.train` run (tpu_dist on an emulated v6e 2x2 slice) into a rollout
engine tensor parallel on the other slice: FSDP2 ranks send their own shards, DDP rank 0 the full state;
and the pieces' checks, in process."""

from __future__ import annotations

import dataclasses
import logging
import time

import _rl_loops  # noqa: E402
import pytest
import ray.cloudpickle
import torch

from tpuray.rl import RolloutConfig, RolloutEngine, WeightMismatchError
from tpuray.rl.run import RLConfig, RLRun, RLRunError
from tpuray.rl.sync.collective import pack, unpack
from tpuray.rl.weights.cut import shard_state, trainer_pieces
from tpuray.rl.weights.join import assemble
from tpuray.validation import ConfigError

ray.cloudpickle.register_pickle_by_value(_rl_loops)

from _rl_util import SCALING, slice_rollout_config  # noqa: E402
from _rl_util import greedy as _greedy  # noqa: E402
from _rl_util import state_dict as _state_dict  # noqa: E402

from _util import alive_actors  # noqa: E402


def test_pieces_assemble_into_each_ranks_shards(tiny_models):
    import json
    from pathlib import Path

    config = json.loads((Path(tiny_models[0]) / "config.json").read_text())
    state = _state_dict(tiny_models[0])
    pieces = trainer_pieces(state, rank=0, tensor_parallel_size=2)
    assert trainer_pieces(state, rank=1, tensor_parallel_size=2) == [{}, {}]  # replicated: rank 0 sends
    for r in range(2):
        got = assemble([pieces[r]], config, r, 2)
        want = shard_state(state, config, r, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    name = "model.layers.0.self_attn.q_proj.weight"
    start, rows = pieces[1][name]
    split = [{**pieces[1], name: (start, rows[:10])}, {name: (start + 10, rows[10:])}]
    assert torch.equal(
        assemble(split, config, 1, 2)["layers.0.qkv"], shard_state(state, config, 1, 2)["layers.0.qkv"]
    )
    with pytest.raises(WeightMismatchError, match=r"q_proj.weight' has 10 of its part's 64 rows"):
        assemble(split[:1], config, 1, 2)
    with pytest.raises(
        WeightMismatchError, match=r"q_proj.weight' has a piece of shape \(54, 128\) at row 12"
    ):
        assemble([split[0], {name: (start + 12, rows[10:])}], config, 1, 2)
    with pytest.raises(WeightMismatchError, match="'model.norm.weight' .* is missing"):
        assemble([{k: v for k, v in pieces[0].items() if k != "model.norm.weight"}], config, 0, 2)
    # tpu_dist: one flat buffer per (trainer rank, rollout rank); what its metadata describes is checked
    # by the receiver after the transfer (the sender never waits on a refusal), before anything is staged
    metas, flat = zip(*(pack(p) for p in pieces), strict=True)
    for r in range(2):
        got = unpack(metas[r], flat[r])
        assert got.keys() == pieces[r].keys()
        assert all(got[k][0] == pieces[r][k][0] and torch.equal(got[k][1], pieces[r][k][1]) for k in got)
    bad = [m if m[0] != name else (name, 0, (63, 128), "float32", m[4]) for m in metas[1]]
    with pytest.raises(WeightMismatchError, match=r"q_proj.weight' has 63 of its part's 64 rows"):
        assemble([unpack(bad, flat[1])], config, 1, 2)
    for wrong, why in (
        ((name, 0, (64, 128), "int64", 0), "is not a floating-point torch dtype"),
        ((name, 0, (64, 128), "float32", flat[1].numel() - 4), "lies outside the"),
    ):
        with pytest.raises(WeightMismatchError, match=why):
            unpack([wrong], flat[1])


def test_rl_config_refuses_bad_values(tiny_models):
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig

    ok = {"rollout": slice_rollout_config(tiny_models[0]), "trainer": ScalingConfig(**SCALING)}
    for bad, named in (
        ({"placement": "split"}, "placement='split' is invalid; valid: disaggregated, colocated"),
        ({"placement": "colocated"}, r"colocated' runs the rollout engine on the trainer's slice"),
        (
            {"placement": "colocated", "rollout": RolloutConfig(tiny_models[0]), "overlap": True},
            "overlap=True is invalid with placement='colocated'",
        ),
        (
            {"placement": "colocated", "rollout": RolloutConfig(tiny_models[0]), "trainer": ScalingConfig()},
            r"colocated' needs one TPU slice for the trainer: ScalingConfig\(use_tpu=False",
        ),
        ({"overlap": "yes"}, "overlap='yes' is invalid"),
        ({"weight_sync": "nccl"}, "weight_sync='nccl' is invalid; valid: object_store, tpu_dist"),
        ({"trainer": ScalingConfig(num_workers=2)}, "use_tpu=False"),
        ({"rollout": RolloutConfig(tiny_models[0])}, "accelerator_type=None"),
        ({"rollout_max_failures": -2}, "rollout_max_failures=-2 is invalid; valid: an integer >= -1"),
        (
            {
                "placement": "colocated",
                "rollout": RolloutConfig(tiny_models[0]),
                "weight_sync": "object_store",
                "rollout_max_failures": -1,
            },
            r"rollout_max_failures=-1 is invalid with placement='colocated'.*FailureConfig",
        ),
        ({"sleep_level": 3}, r"sleep_level=3 is invalid; valid: 1, 2"),
        ({"sleep_level": True}, r"sleep_level=True is invalid; valid: 1, 2"),
        ({"sleep_level": 2}, r"sleep_level=2 is invalid with placement='disaggregated': the engine never"),
    ):
        with pytest.raises(ConfigError, match=named):
            RLConfig(**{**ok, **bad})
    restarts = RunConfig(failure_config=FailureConfig(max_failures=1))
    colocated = RLConfig(RolloutConfig(tiny_models[0]), ok["trainer"], placement="colocated")
    assert colocated.weight_sync == "tpu_dist"  # the default colocated too: the in-process hand-over
    stored = dataclasses.replace(colocated, weight_sync="object_store")
    for config in (
        colocated,
        stored,
        RLConfig(**ok),
    ):  # trainer restarts: both placements (test_placement.py)
        RLRun(config, _rl_loops.rl_loop, run_config=restarts)


def _run(
    tiny_models,
    tmp_path,
    name: str,
    overlap: bool,
    iterations: int,
    rollout_fn,
    sync="object_store",
    restarts=0,
    **loop_config,
):
    from tpuray.train import RunConfig, ScalingConfig

    rl = RLRun(
        RLConfig(
            slice_rollout_config(tiny_models[0]),
            ScalingConfig(**SCALING),
            overlap=overlap,
            weight_sync=sync,
            rollout_max_failures=restarts,
        ),
        _rl_loops.rl_loop,
        train_loop_config={"path": tiny_models[1], **loop_config},
        run_config=RunConfig(storage_path=f"file://{tmp_path}", name=name),
    )
    return rl.run(iterations, rollout_fn)


def _killing(at: set[int], seen: list | None = None, after_s: float = 0.0):
    """A rollout_fn whose engine loses a worker the first time it generates batch k in `at` (after
    `after_s`: with overlap, the trainer's ranks are then most likely mid-transfer into it)."""

    def rollout(engine: RolloutEngine, k: int) -> list:
        if k in at:
            at.discard(k)
            time.sleep(after_s)
            ray.kill(engine.group.actors[1], no_restart=True)
        out = _greedy(engine)
        if seen is not None:
            seen.append(out)
        return out

    return rollout


def test_rl_run_syncs_from_a_tpuray_train_run(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path, caplog
):
    """Trainer (tpuray.train, 2 workers x 2 chips, tpu_dist) on one emulated slice, rollout engine (TP=2)
    on the other. FSDP2 with overlap over tpu_dist: each trainer rank sends its own Shard(0) rows, cut per
    rollout rank, and the engine generates the sent model's tokens one batch later, while rollout workers
    die at batches 1 and 2 (RLConfig.rollout_max_failures=2: new engines, the updates sent again). A run
    needing more slices than exist is refused before anything is reserved; no worker or placement group
    is left. Both sides' first reservations took the slices the run claimed in one request; the
    replacement engines, after the claim let go, reserved their own."""
    from tpuray.train import ScalingConfig

    caplog.set_level(logging.INFO, logger="tpuray.slices.placement")
    two_slices = ScalingConfig(**{**SCALING, "num_workers": 4})  # + the engine's: 3 slices, 2 exist
    with pytest.raises(
        RLRunError, match=r"needs 3 x v6e-4 slice\(s\) at once .* has 2; nothing was reserved"
    ):
        RLRun(RLConfig(slice_rollout_config(tiny_models[0]), two_slices), _rl_loops.rl_loop).run(1, _greedy)

    # FSDP2 with overlap over tpu_dist; the engines generating batches 1 and 2 (while the ranks offer
    # updates 1 and 2) each lose a worker. Batch 1: the group with the engine has not formed yet (it forms
    # when the driver hands the engine its first update), so the ranks offer update 1 to the new engine
    # instead. Batch 2: their transfer into the formed group fails (most likely: 2 s after batch 1 they
    # are in it), they send update 2 again into the next engine, which takes it and generates batch 2
    # again (the tokens are the same with updates 1 and 2)
    full = sum(t.numel() * t.element_size() for t in _state_dict(tiny_models[0]).values())
    result = _run(
        tiny_models,
        tmp_path,
        "fsdp2",
        True,
        3,
        _killing({1, 2}, after_s=2.0),
        "tpu_dist",
        restarts=2,
        strategy="fsdp2",
    )
    assert result.batches == [reference[w] for w in "aab"]  # batch 1 was generated during step 0
    assert result.train_result.return_value == result.batches  # every batch reached rank 0
    assert result.rollout_restarts == 2 and result.versions == [1, 2, 3]
    assert [t.senders for t in result.times] == [2, 2, 2]  # each rollout rank: pieces from both ranks
    assert all(full < t.sync_bytes < 2 * full for t in result.times)  # TP=2: replicated x2
    assert result.times[0].sync > 0 and result.times[2].sync > 0  # (update 2: in the restart, likely)
    lent = [r.args[0] for r in caplog.records if "heads lent by" in r.msg]
    assert len(lent) == 2 and {*lent[0], *lent[1]} == {s.name for s in emulated_cluster.slices}, lent
    assert not alive_actors("TrainWorker")
    pg_leak_check()


@pytest.mark.full(
    "CI: the FSDP2 run over tpu_dist with two engine replacements (test_rl_run_syncs_from_a_tpuray_train_run), a refused update (rl/rollout/test_rollout_engine.py)"
)
def test_ddp_runs_reload_or_resend_after_an_engine_loss_and_end_past_the_limit(
    emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path
):
    """DDP sequential over the object store: rank 0 sends all, a rollout worker killed at batch 1 is
    replaced (a new engine, the last update reloaded), the tokens change from the next batch on, and a
    second loss is past rollout_max_failures=1. DDP sequential over tpu_dist: a restart, then an update
    missing a tensor refused after the transfer, before anything is staged. A failure or refusal ends the
    run with RLRunError (the trainer's own failure: test_placement.py); no worker or placement group is
    left."""
    drop = "model.layers.1.mlp.down_proj.weight"
    seen: list = []
    # DDP over the object store: rank 0 sends all, the tokens change from the next batch on (batch 1 from a
    # new engine, its killed predecessor's update 1 reloaded from the ObjectRefs the run holds); the
    # new engine loses a worker at batch 2: past rollout_max_failures=1, the run ends
    with pytest.raises(
        RLRunError, match=r"the rollout side \(engine or rollout_fn\) failed \(RolloutEngineError"
    ):
        _run(tiny_models, tmp_path, "ddp", False, 3, _killing({1, 2}, seen), restarts=1, strategy="ddp")
    assert seen == [reference[w] for w in "ab"]  # batch 1 from the new engine, update 1 reloaded
    assert not alive_actors("TrainWorker")
    pg_leak_check()

    # DDP sequential over tpu_dist: the engine holding update 1 loses a worker at batch 1; rank 0 sends
    # update 1 again into its replacement (batch 1 shows it); update 2 lacks a tensor: rank 0 sends at
    # once, the engine's workers take every byte offered, then refuse it before anything is staged
    # (the engine keeps update 1) and the run ends
    seen.clear()
    with pytest.raises(RLRunError, match=rf"update 2 was refused: .*'{drop}' .* is missing"):
        _run(
            tiny_models,
            tmp_path,
            "tpu-dist-ddp",
            False,
            3,
            _killing({1}, seen),
            "tpu_dist",
            restarts=1,
            strategy="ddp",
            drop=drop,
            drop_at=1,
        )
    assert seen == [reference[w] for w in "ab"]  # batch 1 from the new engine, with update 1 sent again
    assert not alive_actors("TrainWorker")
    pg_leak_check()


def test_the_mailbox_releases_the_batches_a_committed_checkpoint_covers():
    """`Mailbox.release_batches(i)` (called once report i's checkpoint is committed): a restart resumes
    from checkpoint i or a later one, so a batch some rank read before making report i - 1 goes; one read
    after that, or not read yet, stays (a loop may checkpoint before training on the batch it read)."""
    import asyncio

    from tpuray.rl.sync.mailbox import Mailbox, batch_key

    async def scenario() -> list[int]:
        box = Mailbox(world_size=2)
        for k in range(4):
            await box.put_all({batch_key(k, r): [f"ref{k}"] for r in range(2)})
        for k in range(3):  # batch k read after k reports (take, train, report k); batch 3 not read yet
            for _rank in range(2):
                await box.reading_batch(k, k)
        held = [await box.batches_held()]
        assert await box.release_batches(0) == 0  # checkpoint 0: a restart from it reads batch 1 (or 0)
        held.append(await box.batches_held())
        assert await box.release_batches(2) == 2  # checkpoint 2: batches 0 and 1 go, 2 and 3 stay
        held.append(await box.batches_held())
        assert sorted(box.values) == [batch_key(k, r) for k in (2, 3) for r in range(2)]
        await box.reading_batch(3, 3)
        assert await box.release_batches(2) == 0  # again (a restarted attempt's reports): nothing more
        return held

    assert asyncio.run(scenario()) == [4, 4, 2]
