"""The seed announcement's Ray-actor all_reduce sample, unchanged, on a TPU slice.

    python examples/actor_all_reduce.py                      # starts an emulated v6e 2x2 slice itself
    python examples/actor_all_reduce.py --address ray://...  # or an existing cluster (real or emulated)

The actor code below is the sample verbatim: it imports nothing from tpuray. On emulated hosts
(TPURAY_EMULATION=1, set by the emulator) torch's backend entry point registers the emulated "tpu"
device and "tpu_dist" backend; on a Cloud TPU VM, torch_tpu provides them.
"""

from __future__ import annotations

import argparse
import socket

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# isort: off
# ---------------------------------------------------------------- the seed sample, unchanged
import os
import ray
import torch
import torch.distributed as dist


# On GPU: @ray.remote(num_gpus=1)
@ray.remote(resources={"TPU": 1})
class TorchWorker:
    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        # Ray automatically isolates the assigned device via TPU_VISIBLE_CHIPS
        self.local_rank = os.environ["TPU_VISIBLE_CHIPS"]

    def run_all_reduce(self, master_addr: str, master_port: int):
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["RANK"] = str(self.rank)
        os.environ["LOCAL_RANK"] = self.local_rank

        # On GPU: dist.init_process_group(backend="nccl")
        dist.init_process_group(backend="tpu_dist")

        # On GPU: device = torch.device("cuda")
        device = torch.device("tpu")
        tensor = torch.ones(2, 2, device=device) * self.rank

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu().numpy()


# ---------------------------------------------------------------- end of the seed sample
# isort: on


@ray.remote(num_cpus=0)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run(world_size: int) -> list:
    """Start world_size TorchWorkers; rank 0 (and the TCPStore it hosts) lands on the biggest TPU host."""
    tpu_nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU", 0) > 0]
    if not tpu_nodes:
        raise RuntimeError("no node with TPU resources in this Ray cluster")
    head = max(tpu_nodes, key=lambda n: n["Resources"]["TPU"])
    pin = NodeAffinitySchedulingStrategy(head["NodeID"], soft=False)
    master_addr = head["NodeManagerAddress"]
    master_port = ray.get(_free_port.options(scheduling_strategy=pin).remote())
    workers = [TorchWorker.options(scheduling_strategy=pin).remote(0, world_size)]
    workers += [TorchWorker.remote(rank, world_size) for rank in range(1, world_size)]
    try:
        return ray.get([w.run_all_reduce.remote(master_addr, master_port) for w in workers])
    finally:
        for w in workers:
            ray.kill(w)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", help="existing Ray cluster; default: start an emulated v6e 2x2 slice")
    parser.add_argument("--world-size", type=int, default=4, help="number of TorchWorker actors (chips)")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
        results = run(args.world_size)
    else:
        from tpuray.emulator import EmulatedCluster, SliceRequest

        with EmulatedCluster([SliceRequest("TPU-V6E", "2x2")], head_cpus=1) as cluster:
            cluster.connect()
            results = run(args.world_size)
    expected = sum(range(args.world_size))
    for rank, arr in enumerate(results):
        print(f"rank {rank}: {arr.tolist()}")
    assert all((arr == expected).all() for arr in results), f"expected every element == {expected}"
    print(f"OK: every rank returned the sum of ranks ({expected})")


if __name__ == "__main__":
    main()
