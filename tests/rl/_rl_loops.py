"""Train loops of the tpuray.rl tests (run by tpuray.train workers; pickled by value)."""

from __future__ import annotations

from typing import Any


def load_policy(path: str, strategy: str) -> Any:
    """The HF model at `path` on this worker's device: FSDP2 (`fully_shard` over every rank: each holds
    Shard(0) of every tensor) or DDP (`prepare_model`: every rank holds everything)."""
    import torch
    from transformers import AutoModelForCausalLM

    import tpuray.train.torch as tt
    from tpuray import train

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(tt.get_device())
    if strategy == "ddp":
        return tt.prepare_model(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(tt.get_device().type, (train.get_context().get_world_size(),))
    return fully_shard(model, mesh=mesh)


def send_loop(config: dict) -> int:
    """Load a model and send it as weight update 1; returns the bytes this rank sent."""
    model = load_policy(config["path"], config["strategy"])
    return config["target"].send(model, version=1)


def rl_loop(config: dict) -> list:
    """An RLRun's trainer: take each batch, send the loaded model's weights as the next version (rank 0
    returns the batches it saw); from iteration `drop_at` (default 0) on, sends them without tensor
    `drop` if given."""
    rl = config["rl"]
    model = load_policy(config["path"], config["strategy"])
    dropped = None
    if config.get("drop"):
        from tpuray.rl.weights.cut import model_state

        dropped = {k: v for k, v in model_state(model).items() if k != config["drop"]}
    seen = []
    for k in range(rl.iterations):
        seen.append(rl.batch(k))
        late = dropped is not None and k >= config.get("drop_at", 0)
        rl.send(dropped if late else model, version=k + 1)
    return seen


def restart_loop(config: dict) -> dict:
    """An RLRun's trainer (DDP, or `strategy`) that checkpoints the next iteration after each update and resumes from
    `train.get_checkpoint()`. On the first attempt rank 1, once it sent update `kill_at + 1` and the
    checkpoint before it is committed, kills its own worker (`ray.kill`) instead of checkpointing: the
    restarted attempt resumes at iteration `kill_at` and re-sends that update, which the engine holds.
    With `lose_at` (and `marker`), rank 0 instead ends its process at iteration `lose_at` once its update
    is in the mailbox, before the engine loaded it: the update is lost with it. With `resend`, a resumed
    attempt first sends its restored weights (as version `start`)."""
    import json
    import os
    import tempfile
    import time

    import ray

    from tpuray import train
    from tpuray.train import Checkpoint
    from tpuray.train.checkpoint import join, read_text

    rl, ctx = config["rl"], train.get_context()
    model = load_policy(config["path"], config.get("strategy", "ddp"))
    start, restored = 0, train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d, open(os.path.join(d, "rl.json")) as f:
            start = json.load(f)["next"]

    def committed(k: int) -> None:  # bounded: the driver commits checkpoint k once both ranks reported it
        for _ in range(600):
            state = json.loads(read_text(join(ctx.get_trial_dir(), "run_state.json")) or "{}")
            if state.get("latest_checkpoint") == k:
                return
            time.sleep(0.2)

    if restored is not None and config.get("resend"):  # the restored weights, for an engine that lost them
        rl.send(model, version=start)
    seen = []
    for k in range(start, rl.iterations):
        seen.append(rl.batch(k))
        first = ctx.get_attempt() == 0
        if first and ctx.get_world_rank() == 0 and k == config.get("lose_at"):
            committed(k - 1)
            _exit_once_sent(rl, k + 1, config["marker"])
        rl.send(model, version=k + 1)
        if first and ctx.get_world_rank() == 1 and k == config.get("kill_at"):
            committed(k - 1)
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            time.sleep(600)  # killed meanwhile
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "rl.json"), "w") as f:
                json.dump({"next": k + 1}, f)
            ckpt = Checkpoint.from_directory(d) if ctx.get_world_rank() == 0 else None
            train.report({"k": k}, checkpoint=ckpt)
    return {"attempt": ctx.get_attempt(), "start": start, "seen": seen}


def _exit_once_sent(rl: Any, version: int, marker: str) -> None:
    """In a thread: once the mailbox holds update `version` of this rank (its ObjectRefs, owned by this
    process, or its tpu_dist offer) and of every other rank (so that the driver takes the update as soon
    as it looks), write `marker` and end the process, so the update is lost before the engine loads it."""
    import os
    import threading

    import ray

    from tpuray import train
    from tpuray.rl.sync.mailbox import weight_key

    keys = [weight_key(0, "weights", version, r) for r in range(train.get_context().get_world_size())]

    def watch() -> None:
        for key in keys:  # read, not taken
            ray.get(rl.mailbox.first.remote([key], key, 600))
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def reseed(actor: Any, seed: int) -> None:
    """Through `__ray_call__` on a trainer worker: reseed its process's torch generator (the one vLLM's
    sampler draws unseeded requests from), so that this rank samples apart from the others."""
    import torch

    torch.manual_seed(seed)
