"""The anchors of bench_rl.py: the raw transfers of a weight sync's bytes between plain actors on the
same hosts (Ray's object store: ray.put + ray.get; tpu_dist: send / recv over a group made the way an
RLRun makes its own), what any sync must at least do."""

from __future__ import annotations

import statistics
import time


def puller_class():
    import ray

    @ray.remote(num_cpus=0)
    class Puller:
        def pull(self, state: dict) -> int:  # Ray resolves the ref before the call: the transfer is timed
            return sum(t.numel() * t.element_size() for t in state.values())

    return Puller


def _peer_class():
    import ray

    @ray.remote(num_cpus=0)
    class Peer:
        """One end of the raw transfers: a sender holds flat buffers, a receiver takes them."""

        def __init__(self, sizes: list[int]) -> None:
            import torch

            self.flats = [torch.ones(n, dtype=torch.uint8) for n in sizes]
            self.group = None

        def put(self) -> list:
            return [ray.put(f) for f in self.flats]

        def pull(self, refs: list) -> int:
            return sum(int(t.numel()) for t in ray.get(refs))

        def join(self, channel, rank: int) -> None:
            import torch.distributed as dist

            from tpuray import runtime
            from tpuray.rl.sync.collective import member

            if "tpu_dist" not in dist.Backend.backend_list:
                runtime.activate()
            self.group = member(channel, rank)

        def send(self) -> None:
            self.group.send_all(self.flats)

        def recv(self, offers: list) -> int:
            return sum(sum(t.numel() for _, t in p.values()) for p in self.group.recv_all(offers))

    return Peer


def bench_raw(pair_bytes: list[list[int]], rounds: int) -> dict[str, float]:
    """Median seconds of the raw transfers of `pair_bytes[s][q]` bytes from sender s (on the first TPU
    host) to receiver q (on another): ray.put + ray.get, and send / recv over a tpu_dist group."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tpuray.rl.sync.collective import Offer, Rendezvous

    hosts = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU"))
    peer = _peer_class()

    def on(i: int, sizes: list[int]):
        strategy = NodeAffinitySchedulingStrategy(hosts[i % len(hosts)], soft=False)
        return peer.options(scheduling_strategy=strategy).remote(sizes)

    n_send, n_recv = len(pair_bytes), len(pair_bytes[0])
    senders = [on(0, row) for row in pair_bytes]
    receivers = [on(1, [0]) for _ in range(n_recv)]
    rdv = Rendezvous(n_send, n_recv, 120.0)
    ray.get(
        [s.join.remote(rdv.channel, r) for r, s in enumerate(senders)]
        + [p.join.remote(rdv.channel, n_send + q) for q, p in enumerate(receivers)]
    )
    metas = [
        [
            Offer(s, [("x", 0, (pair_bytes[s][q] // 4,), "float32", 0)], pair_bytes[s][q])
            for s in range(n_send)
        ]
        for q in range(n_recv)
    ]
    store, coll = [], []
    for _ in range(rounds + 1):  # round 0 warms
        t = time.perf_counter()
        refs = ray.get([s.put.remote() for s in senders])
        ray.get([p.pull.remote([refs[s][q] for s in range(n_send)]) for q, p in enumerate(receivers)])
        store.append(time.perf_counter() - t)
        del refs
        t = time.perf_counter()
        ray.get(
            [s.send.remote() for s in senders] + [p.recv.remote(metas[q]) for q, p in enumerate(receivers)]
        )
        coll.append(time.perf_counter() - t)
    for a in senders + receivers:
        ray.kill(a)
    rdv.close()
    return {"object_store": statistics.median(store[1:]), "tpu_dist": statistics.median(coll[1:])}
