"""The tpu_dist weight-sync transport's group (tpuray.rl.sync.collective): gloo on every host (its buffers are
host tensors, which tpu_dist, TorchTPU's and the emulated one, refuses), moving host buffers between two
ranks of a real group, in chunks."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from tpuray.rl.sync.collective import Channel, Offer, SyncGroup, pack


def test_the_group_moves_host_buffers_over_gloo():
    """Trainer rank 0 and rollout rank 0 of a 1 + 1 group, each in its own thread: the packed pieces
    arrive whole, in 1 KiB messages."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    channel = Channel("127.0.0.1", store.port, 1, 1, 30.0, chunk_bytes=1 << 10)
    pieces = {"w": (0, torch.randn(40, 16)), "b": (8, torch.randn(8))}
    metas, flat = pack(pieces)
    assert flat is not None and flat.numel() > 2 * channel.chunk_bytes  # several messages
    got: dict = {}
    pgs: list = []

    def rollout_rank() -> None:
        group = SyncGroup(channel, 1)
        pgs.append(group.pg)
        got.update(group.recv_all([Offer(0, metas, flat.numel())])[0])
        group.close()

    receiver = threading.Thread(target=rollout_rank)
    receiver.start()
    sender = SyncGroup(channel, 0)
    sender.send_all([flat])
    receiver.join(30)
    sender.close()
    assert not receiver.is_alive()
    assert all(isinstance(pg, dist.ProcessGroupGloo) for pg in [sender.pg, *pgs]) and len(pgs) == 1
    assert got.keys() == pieces.keys()
    assert all(got[k][0] == pieces[k][0] and torch.equal(got[k][1], pieces[k][1]) for k in pieces)
