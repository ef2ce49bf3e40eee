"""Training loops for the callback / best-checkpoint tests (pickled by value into the workers)."""

from __future__ import annotations

import json
import os
import tempfile

from tpuray import train
from tpuray.train import Checkpoint


def scored_loop(config: dict) -> None:
    """One report per entry of config["scores"], each with a rank-0 checkpoint and the metric "score"
    (also nested as "val/score"); resumes after the epoch in get_checkpoint(). config["omit_score_at"]:
    the epoch whose report lacks "score"."""
    start = 0
    restored = train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            start = json.load(f)["epoch"]
    rank = train.get_context().get_world_rank()
    for epoch in range(start, len(config["scores"])):
        score = config["scores"][epoch]
        metrics: dict = {"epoch": epoch + 1, "val": {"score": score}, "note": f"epoch {epoch + 1}"}
        if config.get("omit_score_at") != epoch + 1:
            metrics["score"] = score
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"epoch": epoch + 1}, f)
            train.report(metrics, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)


def crash_once_loop(config: dict) -> None:
    """One report per epoch with a rank-0 checkpoint, except at config["crash_after"] (no checkpoint). On
    the first attempt rank 1 then waits for config["marker"] (the test's callback writes it once that
    report reached the driver) and dies (os._exit, as a crashed worker would) while rank 0 waits in a
    barrier with it."""
    import time

    import torch.distributed as dist

    start = 0
    restored = train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            start = json.load(f)["epoch"]
    ctx = train.get_context()
    for epoch in range(start, config["epochs"]):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"epoch": epoch + 1}, f)
            keep = ctx.get_world_rank() == 0 and epoch != config["crash_after"]
            metrics = {"epoch": epoch + 1, "attempt": ctx.get_attempt()}
            train.report(metrics, checkpoint=Checkpoint.from_directory(d) if keep else None)
        if ctx.get_attempt() == 0 and epoch == config["crash_after"]:
            if ctx.get_world_rank() == 1:
                deadline = time.monotonic() + 300
                while not os.path.exists(config["marker"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                os._exit(1)
            dist.barrier()
