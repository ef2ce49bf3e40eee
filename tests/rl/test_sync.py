"""Weight sync from a real `tpuray.train` run (tpu_dist on an emulated v6e 2x2 slice) into a rollout
engine tensor parallel on the other slice: FSDP2 ranks send their own shards, DDP rank 0 the full state;
and the pieces' checks, in process."""

from __future__ import annotations

import functools
import threading
from typing import Any

import _rl_loops  # noqa: E402
import pytest
import ray.cloudpickle
import torch

from tpuray.rl import RolloutConfig, RolloutEngine, WeightMismatchError
from tpuray.rl.sync import WeightSync, assemble, trainer_pieces
from tpuray.rl.weights import shard_state

ray.cloudpickle.register_pickle_by_value(_rl_loops)

from _rl_util import greedy as _greedy  # noqa: E402
from _rl_util import state_dict as _state_dict  # noqa: E402


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


def _fit_in_thread(trainer: Any) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def fit() -> None:
        try:
            out["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    return thread, out


def _check_alive(thread: threading.Thread, out: dict) -> None:
    if not thread.is_alive():
        raise AssertionError(f"the trainer ended: {out}")


def test_sync_from_a_tpuray_train_run(emulated_cluster, pg_leak_check, tiny_models, reference, tmp_path):
    """FSDP2 (each of 2 trainer ranks sends its Shard(0) rows, cut per rollout rank) then DDP (rank 0
    sends all); the engine (TP=2, the other slice) then generates exactly the sent model's tokens."""
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig
    from tpuray.train.torch import TorchTrainer

    cfg = RolloutConfig(
        tiny_models[0], accelerator_type="TPU-V6E", topology="2x2", chips_per_worker=2, max_model_len=64
    )
    scaling = ScalingConfig(
        num_workers=2,
        use_tpu=True,
        topology="2x2",
        accelerator_type="TPU-V6E",
        resources_per_worker={"TPU": 2},
    )
    full = sum(t.numel() * t.element_size() for t in _state_dict(tiny_models[0]).values())
    with RolloutEngine(cfg) as engine:
        for strategy, path, want in (("fsdp2", tiny_models[1], "b"), ("ddp", tiny_models[0], "a")):
            sync = WeightSync(engine.tensor_parallel_size, trainer_world_size=2)
            trainer = TorchTrainer(
                _rl_loops.send_loop,
                train_loop_config={"path": path, "strategy": strategy, "target": sync.target},
                scaling_config=scaling,
                run_config=RunConfig(
                    storage_path=f"file://{tmp_path}",
                    name=strategy,
                    failure_config=FailureConfig(max_failures=0),
                ),
            )
            thread, out = _fit_in_thread(trainer)

            update = sync.receive(1, functools.partial(_check_alive, thread, out))
            senders = [len(refs) for refs in update.refs]
            assert senders == ([2, 2] if strategy == "fsdp2" else [1, 1]), senders
            assert all(n < full for n in update.nbytes)  # each rollout rank receives only its part
            engine.update_weights(update)
            sync.ack(1)
            thread.join(120)
            assert "error" not in out, out
            sent = out["result"].return_value  # rank 0's bytes
            assert (sent < full) if strategy == "fsdp2" else (sent >= full)
            sync.shutdown()
            assert _greedy(engine) == reference[want], strategy
    pg_leak_check()
