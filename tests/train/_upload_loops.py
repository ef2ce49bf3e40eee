"""Training loops for tests/train/test_checkpoint_upload.py (pickled by value to the workers)."""

from __future__ import annotations

import json
import os
import tempfile
import time

from tpuray import train
from tpuray.train import Checkpoint


def _restored_epoch() -> int:
    restored = train.get_checkpoint()
    if restored is None:
        return 0
    with restored.as_directory() as d, open(os.path.join(d, "state.json")) as f:
        return json.load(f)["epoch"]


def checkpoint_loop(config: dict) -> None:
    """Every rank writes its own files into a fresh temporary directory per epoch (deleted as soon as
    report() returns) and reports it. Rank 0's state.json holds the epoch.

    config: epochs; obstacle_at (epoch): rank 0 first puts a directory where its "z.bin" will be uploaded,
    so that upload fails half-way; die_at (epoch): on attempt 0 rank 1 dies right after report() returns,
    while its upload of a 32 MB file is in flight."""
    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    start = _restored_epoch()
    for epoch in range(start, config["epochs"]):
        if config.get("obstacle_at") == epoch + 1 and rank == 0:
            os.makedirs(os.path.join(ctx.get_trial_dir(), f"checkpoint_{epoch:06d}", "z.bin"), exist_ok=True)
        dying = config.get("die_at") == epoch + 1 and rank == 1 and attempt == 0
        with tempfile.TemporaryDirectory() as d:
            files = {f"rank{rank}.bin": f"rank {rank} epoch {epoch + 1}".encode()}
            if rank == 0:
                files["state.json"] = json.dumps({"epoch": epoch + 1}).encode()
                files["z.bin"] = b"b"
            if dying:
                files["big.bin"] = os.urandom(32 << 20)
            for name, data in files.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
            metrics = {"epoch": epoch + 1, "attempt": attempt, "resumed_from": start}
            train.report(metrics, checkpoint=Checkpoint.from_directory(d))
            if dying:
                os._exit(1)


def register_stuck_storage(flag: str | None = None) -> None:
    """fsspec protocol "tpuray-stuck": local files behind a `put` that hangs once (an object store that
    stops answering): the first put after `flag` (a file) exists consumes the flag and never returns.
    (The class is made here, in the calling process: fsspec's classes do not pickle.)"""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class StuckStorage(LocalFileSystem):
        protocol = ("tpuray-stuck",)

        def put(self, lpath, rpath, recursive=False, **kwargs):
            if flag and os.path.exists(flag):
                os.unlink(flag)
                while True:  # until the worker is killed
                    time.sleep(1)
            return super().put(lpath, rpath, recursive=recursive, **kwargs)

    fsspec.register_implementation("tpuray-stuck", StuckStorage, clobber=True)


def stuck_storage_loop(config: dict) -> None:
    """Two epochs, a checkpoint each; the storage hangs on the first upload of the run (config["flag"])."""
    register_stuck_storage(config["flag"])
    start = _restored_epoch()
    for epoch in range(start, 2):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"epoch": epoch + 1}, f)
            ctx = train.get_context()
            train.report({"epoch": epoch + 1, "attempt": ctx.get_attempt()}, Checkpoint.from_directory(d))
