"""Training loops used by the tests (importable by the worker processes through cloudpickle by value)."""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
from torch import nn, optim

import tpuray.train.torch as tt
from tpuray import train
from tpuray.train import Checkpoint
from tpuray.train.checkpoint import write_text

ENV_KEYS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TPU_VISIBLE_CHIPS", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_DEVICES_PER_HOST",
    "TPU_PROCESS_BOUNDS", "TPU_WORKER_ID", "TPURAY_EMULATION", "CLOUD_TPU_TASK_ID", "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_HOST_BOUNDS",
)  # fmt: skip


def _dump_env(out_dir: str, extra: dict) -> None:
    ctx = train.get_context()
    doc = {k: os.environ.get(k) for k in ENV_KEYS}
    doc.update(
        rank=ctx.get_world_rank(),
        world=ctx.get_world_size(),
        local=ctx.get_local_rank(),
        local_world=ctx.get_local_world_size(),
        node=ctx.get_node_rank(),
        node_id=__import__("ray").get_runtime_context().get_node_id(),
        **extra,
    )
    with open(os.path.join(out_dir, f"rank{ctx.get_world_rank()}.json"), "w") as f:
        json.dump(doc, f)


def _resumed(key: str) -> int:
    """`key` from state.pt of the checkpoint this attempt was restored from, else 0."""
    restored = train.get_checkpoint()
    if restored is None:
        return 0
    with restored.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"))[key]


def seed_loop(config: dict) -> str:
    """The seed's loop (10 epochs by default) plus per-rank env dumps and rank-0 checkpoints."""
    device = tt.get_device()
    model = tt.prepare_model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).to(device))
    if config.get("out_dir"):
        _dump_env(config["out_dir"], {"device": str(device), "model": type(model).__name__})
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    inputs = torch.randn(128, 10, device=device)
    targets = inputs.sum(dim=1, keepdim=True)
    for epoch in range(config.get("epochs", 10)):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if config.get("checkpoint") and train.get_context().get_world_rank() == 0:
                torch.save({"epoch": epoch + 1}, os.path.join(d, "state.pt"))
                ckpt = Checkpoint.from_directory(d)
            train.report({"loss": loss.item(), "epoch": epoch + 1}, checkpoint=ckpt)
    return "finished"


def resumable_loop(config: dict) -> None:
    """Checkpoints every epoch; on the first attempt rank 0 signals after `kill_after` epochs and waits
    to be killed (the test kills its host)."""
    start = _resumed("epoch")
    ctx = train.get_context()
    for epoch in range(start, config["epochs"]):
        with tempfile.TemporaryDirectory() as d:
            torch.save({"epoch": epoch + 1}, os.path.join(d, "state.pt"))
            metrics = {
                "epoch": epoch + 1,
                "attempt": ctx.get_attempt(),
                "resumed_from": start,
                "node_id": __import__("ray").get_runtime_context().get_node_id(),
                "slice": os.environ.get("TPU_NAME"),
            }
            train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        if ctx.get_attempt() == 0 and epoch + 1 == config["kill_after"] and ctx.get_world_rank() == 0:
            write_text(
                config["marker"], __import__("ray").get_runtime_context().get_node_id()
            )  # at once: a rename
            deadline = time.monotonic() + config.get("wait_s", 300)
            while time.monotonic() < deadline:  # the test kills this host meanwhile
                time.sleep(0.5)
            raise RuntimeError("the test never killed this host")


def failing_loop(config: dict) -> None:
    for epoch in range(3):
        train.report({"epoch": epoch + 1})
        if epoch + 1 == 2 and train.get_context().get_world_rank() == config["bad_rank"]:
            raise ValueError(f"boom at epoch {epoch + 1} on rank {config['bad_rank']}")


def data_loader_loop(config: dict) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(16, dtype=torch.float32).unsqueeze(1))
    loader = tt.prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True))
    loader.sampler.set_epoch(0)
    seen = [int(x) for (batch,) in loader for x in batch.flatten().tolist()]
    devices = {str(batch.device) for (batch,) in loader}
    ctx = train.get_context()
    with open(os.path.join(config["out_dir"], f"rank{ctx.get_world_rank()}.json"), "w") as f:
        json.dump({"seen": seen, "devices": sorted(devices), "batches": len(loader)}, f)
    train.report({"n": len(seen)})


def env_dump_then(config: dict) -> None:
    """Dump this rank's env, then run config["seed_fn"] (e.g. the example's unchanged seed loop)."""
    _dump_env(config["out_dir"], {})
    config["seed_fn"](config)


MEGASCALE_KEYS = (
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_PORT",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
)


def _dump_attempt_env(out_dir: str, ctx) -> None:
    ray = __import__("ray")
    doc = {k: os.environ.get(k) for k in (*MEGASCALE_KEYS, "TPU_NAME")}
    doc.update(
        rank=ctx.get_world_rank(),
        attempt=ctx.get_attempt(),
        node_id=ray.get_runtime_context().get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
    )
    with open(os.path.join(out_dir, f"attempt{ctx.get_attempt()}-rank{ctx.get_world_rank()}.json"), "w") as f:
        json.dump(doc, f)


def preemptible_loop(config: dict) -> None:
    """One all_reduce'd step every `step_s`, reported each step; a checkpoint every `ckpt_every` steps and
        from rank 0 when the driver asks for one (`should_checkpoint()`, after a preemption notice). Rank 0 writes
        its node id to `marker` once it made `signal_at` steps on the first attempt (a list: its i-th
        entry counts the steps attempt i made since it resumed, to `marker.i` for i > 0). With `env_dir`, every rank
    dumps its MEGASCALE_* env there at the first step of each attempt."""
    import torch.distributed as dist

    start = _resumed("step")
    ctx = train.get_context()
    device = tt.get_device()
    for step in range(start, config["steps"]):
        value = torch.ones(2, device=device)
        dist.all_reduce(value)
        time.sleep(config.get("step_s", 0.2))
        notice = train.get_preemption_info()
        metrics = {
            "step": step + 1,
            "attempt": ctx.get_attempt(),
            "resumed_from": start,
            "t": time.time(),
            "sum": float(value[0]),
            "node_id": __import__("ray").get_runtime_context().get_node_id(),
            "slice": os.environ.get("TPU_NAME"),
            "notice_deadline_ms": notice.deadline_ms if notice else None,
            "notice_ranks": notice.preempted_ranks if notice else None,
        }
        if step == start and config.get("env_dir"):  # each rank's multi-slice env, once per attempt
            _dump_attempt_env(config["env_dir"], ctx)
        asked = ctx.should_checkpoint() and ctx.get_world_rank() == 0  # DDP: rank 0 saves the state
        if asked or (step + 1) % config.get("ckpt_every", 10**9) == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"step": step + 1}, os.path.join(d, "state.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
        signal_at, attempt = config.get("signal_at"), ctx.get_attempt()
        at = [signal_at] if isinstance(signal_at, int) else list(signal_at or [])
        if attempt < len(at) and step + 1 - start == at[attempt] and ctx.get_world_rank() == 0:
            suffix = f".{attempt}" if attempt else ""
            write_text(config["marker"] + suffix, metrics["node_id"])  # at once: a rename
