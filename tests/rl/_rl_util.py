"""Helpers of the tpuray.rl tests: a model's state dict from disk, an engine's greedy tokens, a run's
latest committed checkpoint."""

from __future__ import annotations

import json
from typing import Any

import torch

from _util import TWO_WORKERS_V6E_2X2, live_processes
from tpuray.serve.llm.generation import SamplingParams

PROMPTS = ["Hello world", "1 + 2 =", "The"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def greedy(engine: Any) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


def latest_checkpoint(storage: str, name: str) -> int:
    """The report index of tpuray.train run `name`'s latest committed checkpoint under `storage` (its
    run_state.json; -1: none yet)."""
    from tpuray.train.checkpoint import join, read_text

    latest = json.loads(read_text(join(storage, name, "run_state.json")) or "{}").get("latest_checkpoint")
    return -1 if latest is None else int(latest)


SCALING = TWO_WORKERS_V6E_2X2  # a tpuray.train trainer of 2 workers x 2 chips on one emulated v6e 2x2


def slice_rollout_config(path: str, **kw: Any) -> Any:
    """A rollout engine TP=2 on an emulated v6e 2x2 slice."""
    from tpuray.rl import RolloutConfig

    return RolloutConfig(
        path, accelerator_type="TPU-V6E", topology="2x2", chips_per_worker=2, max_model_len=64, **kw
    )


def kill(actor: Any) -> None:
    """Kill an actor and wait until it is gone (ray.kill does not wait): its next call fails."""
    import time

    import ray

    ray.kill(actor, no_restart=True)
    try:
        while True:
            ray.get(actor.__ray_call__.remote(lambda self: None), timeout=30)
            time.sleep(0.1)
    except ray.exceptions.RayActorError:
        pass


def orphaned(value: Any) -> Any:
    """An ObjectRef of `value` whose owner (a process made for it) is gone: pulling it raises Ray's
    ObjectLostError. The owner runs on the driver's (CPU) node: a rollout worker on the owner's node
    could still read the object from its node's store until that raylet frees it, asynchronously after
    the owner's death."""
    import ray

    from tpuray.rl.sync.driver import on_this_node

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self, value: Any) -> list:
            return [ray.put(value)]  # in a list: the caller gets this actor's ref, not the value

    owner = Owner.options(scheduling_strategy=on_this_node()).remote()
    (ref,) = ray.get(owner.put.remote(value))
    pid = ray.get(owner.__ray_call__.remote(lambda self: __import__("os").getpid()))
    kill(owner)
    # Ray reports the actor dead before its process has exited: until it has, it still answers where its
    # objects are, and a pull of the ref can succeed (seen on a loaded machine)
    assert not live_processes([pid]), f"the owner's process {pid} outlived its kill"
    return ref
