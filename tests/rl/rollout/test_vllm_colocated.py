"""Colocated vLLM (tpuray.rl.rollout.vllm_colocated): an RLRun whose rollout engine is real vLLM (its CPU
build) running inside the trainer's own worker processes on one emulated slice, vLLM's tensor parallelism over
the trainer's ranks (vLLM's external launcher on the trainer's process group)."""

from __future__ import annotations

from pathlib import Path

import _rl_loops
import pytest
import ray.cloudpickle
import torch
from _rl_util import GREEDY, PROMPTS, SCALING, latest_checkpoint

from tpuray.serve.llm.engine.vllm import vllm_available

ray.cloudpickle.register_pickle_by_value(_rl_loops)  # the train loop goes to the workers by value
pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"
)


def _hf_greedy(path: str, tokenizer) -> list[list[int]]:
    """Greedy tokens of the model at `path` computed with Hugging Face transformers (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        new: list[int] = []
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                logits = model(torch.tensor([ids + new])).logits[0, -1]
                new.append(int(logits.argmax()))
        out.append(new)
    return out


@pytest.mark.full(
    "CI: the colocated RLRun with the embedded engine (rl/test_placement.py), vLLM as a disaggregated "
    "rollout engine (full tier: rl/rollout/test_vllm_rollout.py), vLLM's weight layout (rl/weights/test_vllm_layout.py)"
)
@pytest.mark.parametrize("weight_sync", ["object_store", "tpu_dist"])
def test_colocated_vllm_takes_turns_with_the_trainer(
    emulated_cluster, pg_leak_check, vllm_models, tmp_path, weight_sync
):
    """vLLM TP=2 in the two workers of an FSDP2 trainer on one v6e 2x2: before batch 0, a full state dict
    (b's, then a misshapen one refused with b's kept, then a's again); batch 0 with model a's weights,
    then the trainer's updates (model b: over "object_store" each rank's Shard(0) rows cut in vLLM's
    layout, pulled by every vLLM rank; over "tpu_dist" each vLLM rank's part gathered over the trainer's
    group and left in its process, `tpuray.rl.sync.handover`) loaded into each vLLM rank in its own process;
    the tokens are those of Hugging Face's greedy decoding of a, then of b. vLLM's CPU backend has no sleep mode, so each rank frees its KV cache's memory between
    rollouts: freed > 0 every iteration. Nothing is left."""
    from _rl_util import state_dict
    from transformers import AutoTokenizer

    from _util import alive_actors
    from tpuray.rl import RLConfig, RLRun, RolloutConfig, WeightMismatchError
    from tpuray.rl.rollout.vllm_colocated import ColocatedVLLMEngine
    from tpuray.serve.llm.generation import SamplingParams
    from tpuray.train import RunConfig, ScalingConfig

    a, b = vllm_models
    want = {
        name: _hf_greedy(path, AutoTokenizer.from_pretrained(path))
        for name, path in zip("ab", vllm_models, strict=True)
    }
    assert want["a"] != want["b"]
    engines: list = []

    def greedy(engine) -> list:
        return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]

    def rollout_fn(engine, k: int) -> list:
        assert isinstance(engine, ColocatedVLLMEngine) and not engine.asleep
        assert engine.tensor_parallel_size == 2
        engines.append(engine)
        if k == 0:  # a full state dict: put once, every rank stages all of it; a misshapen one refused
            engine.update_weights(state_dict(b))
            assert greedy(engine) == want["b"]
            bad = {**state_dict(a), "model.norm.weight": torch.zeros(3)}
            with pytest.raises(WeightMismatchError, match="model.norm.weight"):
                engine.update_weights(bad)
            assert greedy(engine) == want["b"]  # old weights kept
            engine.update_weights(state_dict(a))
            for seed in (None, 7):  # sampled on every rank: the ranks' tokens agree (checked by the engine)
                sampled = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=seed))
                assert all(len(r.token_ids) == len(r.logprobs) > 0 for r in sampled)
        return greedy(engine)

    shm_before = set(Path("/dev/shm").glob("tpuray*-cpushm_*"))  # vLLM's CPU groups' shared memory
    rollout = RolloutConfig(a, engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32")
    rl = RLRun(
        RLConfig(rollout, ScalingConfig(**SCALING), placement="colocated", weight_sync=weight_sync),
        _rl_loops.rl_loop,
        train_loop_config={"path": b, "strategy": "fsdp2"},
        run_config=RunConfig(storage_path=f"file://{tmp_path}", name=f"colocated-vllm-{weight_sync}"),
    )
    result = rl.run(2, rollout_fn)
    assert result.versions == [1, 2]
    assert result.batches == [want["a"], want["b"]]  # update 1 (b) loaded in place, on-policy
    assert len({id(e) for e in engines}) == 1  # one engine, woken up for each batch
    senders = 2 if weight_sync == "object_store" else 1  # in process: each rank's own trainer rank
    assert all(t.freed > 0 for t in result.times) and [t.senders for t in result.times] == [senders] * 2
    assert not alive_actors("TrainWorker")
    assert set(Path("/dev/shm").glob("tpuray*-cpushm_*")) <= shm_before
    pg_leak_check()


def test_ranks_disagree_names_the_first_prompt_and_rank_apart():
    from tpuray.rl.rollout.vllm_colocated import disagreement

    assert disagreement([[[1, 2], [3]], [[1, 2], [3]]]) is None
    assert disagreement([[[1, 2], [3]], [[1, 2], [3]], [[1, 2], [4]]]) == "prompt 1: rank 0 [3], rank 2 [4]"
    assert disagreement([[[5]]]) is None  # one rank


@pytest.mark.full(
    "CI: the ranks' tokens compared (test_ranks_disagree_names_the_first_prompt_and_rank_apart) and sampled "
    "alike unseeded and seeded (test_colocated_vllm_takes_turns_with_the_trainer, full tier too)"
)
def test_ranks_sampling_apart_fail_the_engine_and_end_the_run(
    emulated_cluster, pg_leak_check, vllm_models, tmp_path
):
    """Rank 1's torch generator reseeded in its trainer worker, an unseeded sampled batch (ignore_eos:
    the ranks' schedules stay alike, so no collective hangs) comes back with different tokens per rank:
    generate raises RolloutEngineError naming the prompt and both ranks' tokens, the engine refuses any
    further call, and the RL run ends with RLRunError; no worker or placement group is left."""
    from _util import alive_actors
    from tpuray.rl import RLConfig, RLRun, RolloutConfig, RolloutEngineError
    from tpuray.rl.run import RLRunError
    from tpuray.serve.llm.generation import SamplingParams
    from tpuray.train import RunConfig, ScalingConfig

    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)

    def rollout_fn(engine, k: int) -> list:
        engine.generate(PROMPTS, sampled)  # in step: the ranks agree
        ray.get(engine.group.actors[1].__ray_call__.remote(_rl_loops.reseed, 1234))
        with pytest.raises(
            RolloutEngineError, match=r"sampled different tokens .*prompt \d+: rank 0 .*rank 1"
        ):
            engine.generate(PROMPTS, sampled)
        with pytest.raises(RolloutEngineError, match="failed earlier"):
            engine.generate(PROMPTS, GREEDY)
        return []

    rollout = RolloutConfig(vllm_models[0], engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32")
    rl = RLRun(
        RLConfig(rollout, ScalingConfig(**SCALING), placement="colocated", weight_sync="object_store"),
        _rl_loops.rl_loop,
        train_loop_config={"path": vllm_models[1], "strategy": "fsdp2"},
        run_config=RunConfig(storage_path=f"file://{tmp_path}", name="colocated-vllm-apart"),
    )
    with pytest.raises(RLRunError, match="RolloutEngineError"):
        rl.run(1, rollout_fn)
    assert not alive_actors("TrainWorker")
    pg_leak_check()


@pytest.mark.full(
    "CI: a killed trainer worker of a colocated run with the embedded engine (rl/test_placement.py)"
)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_dead_trainer_worker_with_colocated_vllm(
    emulated_cluster, pg_leak_check, vllm_models, tmp_path, restarts
):
    """A trainer worker (vLLM's rank 1) killed while batch 1 is due, once checkpoint 0 is committed: rank
    0's tensor-parallel collective fails with its peer's connection (no hang), the engine raises
    RolloutEngineError. Without trainer restarts the run ends with RLRunError; with one, the trainer
    resumes from checkpoint 0 (at iteration 1) and a new vLLM engine starts in the new workers with
    update 1, generates batch 1 again and the run completes. No worker or placement group is left."""
    import time

    from _rl_util import kill

    from _util import alive_actors
    from tpuray.rl import RLConfig, RLRun, RolloutConfig
    from tpuray.rl.run import RLRunError
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig

    calls: list = []

    def rollout_fn(engine, k: int) -> list:
        calls.append((k, tuple(engine.group.actors)))
        if k == 1 and len(calls) == 2:
            while latest_checkpoint(f"file://{tmp_path}", "colocated-vllm") != 0:
                time.sleep(0.2)
            kill(engine.group.actors[1])
        return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]

    rollout = RolloutConfig(vllm_models[0], engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32")
    rl = RLRun(
        RLConfig(rollout, ScalingConfig(**SCALING), placement="colocated", weight_sync="object_store"),
        _rl_loops.restart_loop,
        train_loop_config={"path": vllm_models[1], "kill_at": -1, "strategy": "fsdp2"},
        run_config=RunConfig(
            storage_path=f"file://{tmp_path}",
            name="colocated-vllm",
            failure_config=FailureConfig(max_failures=restarts),
        ),
    )
    if restarts:
        result = rl.run(3, rollout_fn)
        assert [k for k, _ in calls] == [0, 1, 1, 2] and calls[1][1] != calls[2][1]  # new workers
        assert result.versions == [1, 2, 3]
        assert result.batches[0] != result.batches[1] == result.batches[2]  # a's, then b's twice
    else:
        with pytest.raises(RLRunError, match=r"the rollout side .*RolloutEngineError.*a rollout worker"):
            rl.run(3, rollout_fn)
    assert not alive_actors("TrainWorker")
    pg_leak_check()
