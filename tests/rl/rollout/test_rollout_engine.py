"""tpuray.rl.RolloutEngine over the embedded engine (`rollout_engine`): in this process and tensor parallel on
an emulated v6e 2x2 slice (real Ray workers, real tpu_dist group): generate, update_weights, sleep / wake_up."""

from __future__ import annotations

import pytest
import torch
from _rl_util import GREEDY, PROMPTS, orphaned
from _rl_util import greedy as _greedy
from _rl_util import state_dict as _state_dict

from tpuray.rl import (
    RolloutConfig,
    RolloutEngine,
    RolloutEngineError,
    ShardedUpdate,
    UpdateLostError,
    WeightMismatchError,
    put_shards,
    rollout_engine,
)
from tpuray.serve.llm.generation import SamplingParams
from tpuray.validation import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"engine": "vLLM"}, "engine='vLLM'"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"accelerator_type": "TPU-V6E"}, "topology=None"),
        ({"chips_per_worker": 2}, "chips_per_worker=2"),
        ({"accelerator_type": "TPU-V6E", "topology": "2x2", "chips_per_worker": 3}, "TPU=3"),
    ],
)
def test_config_refuses_bad_values(tiny_models, kwargs, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        RolloutConfig(tiny_models[0], **kwargs)


def test_the_factory_makes_the_engine_the_config_names(tiny_models):
    from tpuray.rl.rollout.embedded import EmbeddedRolloutEngine

    config = RolloutConfig(tiny_models[0], engine="embedded", max_model_len=64, max_num_seqs=4)
    with pytest.raises(TypeError, match=r"make one with tpuray.rl.rollout_engine\(config\)"):
        RolloutEngine(config)
    with pytest.raises(TypeError, match="config must be a RolloutConfig, got str"):
        rollout_engine(tiny_models[0])
    with rollout_engine(config) as engine:
        assert type(engine) is EmbeddedRolloutEngine and isinstance(engine, RolloutEngine)


def test_generate_in_process_returns_tokens_logprobs_and_text(tiny_models):
    with rollout_engine(RolloutConfig(tiny_models[0], max_model_len=64, max_num_seqs=4)) as engine:
        sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
        rollouts = engine.generate(["1 + 2 ="] * 4, sampled)
        assert [len(r.token_ids) for r in rollouts] == [6] * 4
        assert all(len(r.logprobs) == 6 and all(lp <= 0 for lp in r.logprobs) for r in rollouts)
        assert len({tuple(r.token_ids) for r in rollouts}) > 1  # one generator per row
        assert rollouts[0].text == engine.tokenizer.decode(rollouts[0].token_ids, skip_special_tokens=True)
        assert [r.token_ids for r in engine.generate(["1 + 2 ="] * 4, sampled)] == [
            r.token_ids for r in rollouts
        ]  # seeded: reproducible
        grouped = engine.generate(["1 + 2 =", "3 + 4 ="], sampled, n=2)  # prompt i's samples at [2i, 2i + 2)
        assert [r.token_ids for r in grouped] == [
            r.token_ids for r in engine.generate(["1 + 2 =", "1 + 2 =", "3 + 4 =", "3 + 4 ="], sampled)
        ]
        assert grouped[0].prompt_token_ids == grouped[1].prompt_token_ids != grouped[2].prompt_token_ids
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match=r"n \(samples per prompt\) must be an int >= 1, got"):
                engine.generate(["a"], GREEDY, n=bad)
        with pytest.raises(ValueError, match=r"params must be one SamplingParams or one per prompt \(2\)"):
            engine.generate(["a", "b"], [GREEDY])
        with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
            engine.generate(["a", []], GREEDY)
    with pytest.raises(RuntimeError, match="after shutdown"):
        engine.generate(["a"], GREEDY)


def test_update_weights_in_process(tiny_models, reference):
    with rollout_engine(RolloutConfig(tiny_models[0], max_model_len=64, max_num_seqs=4)) as engine:
        assert _greedy(engine) == reference["a"]
        stats = engine.update_weights(_state_dict(tiny_models[1]))
        assert stats.version == 1 and stats.bytes_written > 0
        assert _greedy(engine) == reference["b"]
        # refused before anything is written: the engine keeps model b
        bad = _state_dict(tiny_models[0])
        bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
        with pytest.raises(
            WeightMismatchError,
            match=r"'model.layers.1.mlp.up_proj.weight' has shape \(3, 3\); expected \(256, 128\)",
        ):
            engine.update_weights(bad)
        del bad["model.layers.1.mlp.up_proj.weight"]
        with pytest.raises(WeightMismatchError, match="'model.layers.1.mlp.up_proj.weight' .* is missing"):
            engine.update_weights(bad)
        with pytest.raises(
            WeightMismatchError, match="'model.norm.weight' has dtype torch.int64; valid: a floating"
        ):
            engine.update_weights(
                {**_state_dict(tiny_models[0]), "model.norm.weight": torch.zeros(128, dtype=torch.long)}
            )
        with pytest.raises(WeightMismatchError, match="'model.norm.weight' is a list, not a torch.Tensor"):
            engine.update_weights({**_state_dict(tiny_models[0]), "model.norm.weight": [0.0] * 128})
        with pytest.raises(WeightMismatchError, match="unknown tensor 'extra.weight'"):
            engine.update_weights({**_state_dict(tiny_models[0]), "extra.weight": torch.zeros(1)})
        assert _greedy(engine) == reference["b"] and engine.version == 1
        # sleep: the chips' memory is freed; an update while asleep lands on wake-up
        assert engine.sleep() > 0 and engine.asleep
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(PROMPTS, GREEDY)
        engine.update_weights(_state_dict(tiny_models[0]))
        assert engine.wake_up() > 0 and not engine.asleep
        assert _greedy(engine) == reference["a"]
        # level 2: the weights are discarded, not copied to the host; the next update must come first
        with pytest.raises(ValueError, match=r"sleep\(level=3\) is invalid; valid: 1 .*, 2 "):
            engine.sleep(level=3)
        assert engine.sleep(level=2) > 0 and engine.asleep
        with pytest.raises(RuntimeError, match=r"wake_up after sleep\(level=2\): the weights were discarded"):
            engine.wake_up()
        assert engine.asleep
        stats = engine.update_weights(_state_dict(tiny_models[1]))
        assert stats.bytes_written > 0 and engine.wake_up() > 0
        assert _greedy(engine) == reference["b"]


def test_rollout_engine_on_an_emulated_slice(emulated_cluster, pg_leak_check, tiny_models, reference):
    """TP=2 on a v6e 2x2 slice (two workers of two chips): each rank takes its own shard of an update
    sent through the object store; a mismatch is refused by the workers, and an update whose objects were
    lost with their owner, or whose tpu_dist transfer was cut half-way by its sender's death, raises
    UpdateLostError, with the old weights kept."""
    import ray

    cfg = RolloutConfig(
        tiny_models[0],
        accelerator_type="TPU-V6E",
        topology="2x2",
        chips_per_worker=2,
        max_model_len=64,
        max_num_seqs=4,
    )
    engine = rollout_engine(cfg)
    try:
        assert engine.tensor_parallel_size == 2 and engine.group is not None
        assert engine.group.world_size == 2 and engine.describe()["emulated"]
        assert _greedy(engine) == reference["a"]
        engine.update_weights(_state_dict(tiny_models[1]))
        assert _greedy(engine) == reference["b"]
        bad = _state_dict(tiny_models[0])
        bad["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(128, 64)
        with pytest.raises(
            WeightMismatchError, match=r"o_proj.weight' has shape \(128, 64\); expected \(128, 128\)"
        ):
            engine.update_weights(ray.put(bad))  # checked by the workers (the driver never sees the tensors)
        assert _greedy(engine) == reference["b"]
        refs = {k: ray.put(v) for k, v in _state_dict(tiny_models[0]).items()}  # one ref per tensor
        assert engine.sleep() > 0
        engine.update_weights(refs)
        engine.wake_up()
        assert _greedy(engine) == reference["a"]
        # pre-cut per rank where the state lives: each rank receives only its part
        state_b = _state_dict(tiny_models[1])
        full = sum(t.numel() * t.element_size() for t in state_b.values())
        with pytest.raises(
            WeightMismatchError, match="tensor_parallel_size=4; this engine runs tensor_parallel_size=2"
        ):
            engine.update_weights(put_shards(state_b, engine.model_config, 4))
        sharded = put_shards(state_b, engine.model_config, 2)
        assert all(n < full for n in sharded.nbytes)
        bad = ray.get(sharded.refs[1])
        bad["layers.1.gate_up"] = bad["layers.1.gate_up"][:-1]
        with pytest.raises(
            WeightMismatchError,
            match=r"shard 'layers.1.gate_up' has shape \(255, 128\); expected \(256, 128\)",
        ):
            engine.update_weights(ShardedUpdate((sharded.refs[0], ray.put(bad)), sharded.nbytes))
        assert _greedy(engine) == reference["a"]

        # rank 1's part owned by a process that is gone: nothing is loaded, the engine goes on
        orphan = orphaned(ray.get(sharded.refs[1]))
        with pytest.raises(
            UpdateLostError, match=r"lost before every rollout worker had them; the engine keeps its weights"
        ):
            engine.update_weights(ShardedUpdate((sharded.refs[0], orphan), sharded.nbytes))
        assert _greedy(engine) == reference["a"]
        engine.update_weights(sharded)
        assert _greedy(engine) == reference["b"]

        # over tpu_dist, cut half-way: the sender dies after the first chunk of each buffer went
        _send_half_and_die(engine, _state_dict(tiny_models[0]))
        assert _greedy(engine) == reference["b"]
    finally:
        engine.shutdown()
    pg_leak_check()


def _send_half_and_die(engine: RolloutEngine, state: dict) -> None:
    """An update over tpu_dist whose sender dies half-way (after its buffers' first chunks): the engine
    raises UpdateLostError and stages nothing."""
    import ray

    from tpuray.rl.sync.collective import Rendezvous
    from tpuray.rl.sync.driver import on_this_node
    from tpuray.rl.sync.update import TrainerUpdate

    @ray.remote(num_cpus=0)
    class HalfSender:
        """Trainer rank 0 of the group (of one trainer rank): sends each rollout rank only the first
        chunk of its buffer, then dies."""

        def offer(self, state: dict, tensor_parallel_size: int) -> list:
            from tpuray.rl.sync.collective import Offer, pack
            from tpuray.rl.weights.cut import trainer_pieces

            packed = [pack(p) for p in trainer_pieces(state, 0, tensor_parallel_size, compact=False)]
            self.flats = [flat for _, flat in packed]
            return [Offer(0, metas, flat.numel()) for metas, flat in packed]

        def send_first_chunks_and_exit(self, channel) -> None:
            import os

            from tpuray import runtime
            from tpuray.rl.sync.collective import chunks, member

            runtime.activate()
            group = member(channel, 0)
            firsts = [chunks(flat, channel.chunk_bytes) for flat in self.flats]
            assert all(len(c) > 1 for c in firsts)
            works = [group.pg.send([c[0]], channel.rollout_rank(q), 0) for q, c in enumerate(firsts)]
            for w in works:
                w.wait()
            os._exit(1)

    tp = engine.tensor_parallel_size
    rdv = Rendezvous(1, tp, timeout_s=60.0, chunk_bytes=64 << 10)  # the tiny model's buffers: many chunks
    try:
        sender = HalfSender.options(scheduling_strategy=on_this_node()).remote()
        offers = ray.get(sender.offer.remote(state, tp))
        dying = sender.send_first_chunks_and_exit.remote(rdv.channel)
        update = TrainerUpdate(
            tuple((o,) for o in offers), tuple(o.nbytes for o in offers), rdv.channel, version=9
        )
        with pytest.raises(
            UpdateLostError,
            match=r"TransferError: .*trainer rank 0 did not arrive whole over tpu_dist.*Connection (closed|reset) by peer",
        ):
            engine.update_weights(update)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dying)
    finally:
        rdv.close()


def test_update_weights_casts_to_the_engine_dtype(tiny_models):
    """A float32 trainer state into a bfloat16 engine: the same tokens as the engine loaded from disk."""
    cfg = {"max_model_len": 64, "max_num_seqs": 4, "dtype": "bfloat16"}
    with rollout_engine(RolloutConfig(tiny_models[1], **cfg)) as engine:
        want = _greedy(engine)
    with rollout_engine(RolloutConfig(tiny_models[0], **cfg)) as engine:
        engine.update_weights(_state_dict(tiny_models[1]))
        assert _greedy(engine) == want


def test_a_dead_worker_fails_generate_and_shutdown_frees_the_slice(
    emulated_cluster, pg_leak_check, tiny_models
):
    import ray

    cfg = RolloutConfig(
        tiny_models[0], accelerator_type="TPU-V6E", topology="2x2", chips_per_worker=2, max_model_len=64
    )
    engine = rollout_engine(cfg)
    try:
        assert engine.group is not None
        ray.kill(engine.group.actors[1], no_restart=True)
        with pytest.raises(RolloutEngineError, match="a rollout worker of .* died"):
            engine.generate(PROMPTS, GREEDY)
        with pytest.raises(RolloutEngineError, match="update_weights: a rollout worker failed earlier"):
            engine.update_weights(_state_dict(tiny_models[1]))
    finally:
        engine.shutdown()
    pg_leak_check()


def test_a_state_dict_reaches_the_object_store_as_host_tensors_of_their_own_bytes():
    import pickle

    from tpuray.rl.rollout.engine import host_state

    fused = torch.arange(8 * 1024, dtype=torch.float32).reshape(8, 1024)
    state = {f"q.{i}": chunk for i, chunk in enumerate(fused.chunk(8))} | {
        "t": fused.t(),
        "n": "not a tensor",
    }
    hosted = host_state(state)
    assert all(torch.equal(hosted[k], state[k]) for k in state if k != "n") and hosted["n"] == "not a tensor"
    assert all(t.untyped_storage().nbytes() == t.nbytes for k, t in hosted.items() if k != "n")
    assert len(pickle.dumps(hosted["q.0"])) < 2 * 4096 < len(pickle.dumps(state["q.0"]))  # not all 32 KiB
