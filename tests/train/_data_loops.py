"""Training loops and Ray Data functions for tests/train/test_data.py (pickled by value to the workers)."""

from __future__ import annotations

import json
import os
import uuid

from tpuray import train


def tag_node(batch: dict, out: str) -> dict:
    """map_batches fn: records the node it ran on (a file per call in `out`), adds x = 2 * id."""
    import ray

    with open(os.path.join(out, f"{uuid.uuid4().hex}.node"), "w") as f:
        f.write(ray.get_runtime_context().get_node_id())
    batch["x"] = batch["id"] * 2
    return batch


def _dump(config: dict, name: str, doc: dict) -> None:
    ctx = train.get_context()
    path = os.path.join(
        config["out_dir"], f"{name}-attempt{ctx.get_attempt()}-rank{ctx.get_world_rank()}.json"
    )
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def first_then_shards(config: dict) -> None:
    """config["first"](config) (e.g. the seed sample), then shard_loop: one fit checks both."""
    config["first"](config)
    shard_loop(config)


def shard_loop(config: dict) -> None:
    """`epochs` passes over the "train" shard with iter_torch_batches (default device), one pass over
    "val" (if any) with iter_rows; per rank: ids seen per epoch, batch devices, val ids."""
    shard = train.get_dataset_shard("train")
    ctx = train.get_context()
    epochs, devices = [], set()
    for epoch in range(config["epochs"]):
        ids = []
        for i, batch in enumerate(shard.iter_torch_batches(batch_size=4)):
            devices.add(batch["id"].device.type)
            assert (batch["x"] == batch["id"] * 2).all()
            ids += [int(v) for v in batch["id"].cpu().tolist()]
            crash = config.get("crash_rank")
            if crash == ctx.get_world_rank() and ctx.get_attempt() == 0 and epoch == 1 and i == 1:
                os._exit(1)  # the worker process dies mid-epoch (as a crashed/OOM-killed one would)
        epochs.append(ids)
        train.report({"epoch": epoch + 1, "attempt": ctx.get_attempt(), "rows": len(ids)})
    from ray.data import DataIterator

    doc = {"epochs": epochs, "devices": sorted(devices), "is_data_iterator": isinstance(shard, DataIterator)}
    if config.get("val"):
        doc["val"] = sorted(int(row["id"]) for row in train.get_dataset_shard("val").iter_rows())
    _dump(config, "shard", doc)
