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
    returns the batches it saw); raises at iteration `fail_at`; sends without tensor `drop` if given."""
    rl = config["rl"]
    model = load_policy(config["path"], config["strategy"])
    if config.get("drop"):
        from tpuray.rl.sync import model_state

        model = {k: v for k, v in model_state(model).items() if k != config["drop"]}
    seen = []
    for k in range(rl.iterations):
        seen.append(rl.batch(k))
        if config.get("fail_at") == k:
            raise RuntimeError(f"trainer failure injected at iteration {k}")
        rl.send(model, version=k + 1)
    return seen
