# ruff: noqa: E302, E305, F401, I001  (the announcement's sample kept verbatim)
# fmt: off
"""The announcement's TorchTrainer sample VERBATIM, with Ray Train itself (`from ray import train`), on an
EMULATED TPU slice: Ray 2.60's own `use_tpu=True` path (its SlicePlacementGroup, its `tpu_dist` set-up,
its get_device / prepare_model) runs unchanged, because tpuray's emulated hosts carry the labels,
resources and env of real TPU hosts, and an emulated `torch_tpu` (tpuray's CPU-backed tpu device and
gloo-backed tpu_dist) sits on their import path.

    .venv/bin/python examples/ray_train_seed.py          # the seed's 4x4: 16 workers on 4 emulated hosts
    .venv/bin/python examples/ray_train_seed.py 2x2      # 4 workers on one emulated host
"""

import ray
from ray import train
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
import torch
from torch import nn, optim
import torch.distributed as dist

def train_fn_per_worker(config):
    # Automatically resolves to torch.device("tpu") on TPU workers
    device = ray.train.torch.get_device()

    model = nn.Sequential(
        nn.Linear(10, 32),
        nn.ReLU(),
        nn.Linear(32, 1),
    ).to(device)

    # Wraps the model in DDP over the "tpu_dist" backend
    model = ray.train.torch.prepare_model(model)

    criterion = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.05)

    inputs = torch.randn(128, 10, device=device)
    targets = inputs.sum(dim=1, keepdim=True)

    for epoch in range(10):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()

        train.report({"loss": loss.item(), "epoch": epoch + 1})

scaling_config = ScalingConfig(
    num_workers=16,
    use_tpu=True,
    topology="4x4",
    accelerator_type="TPU-V6E",
    resources_per_worker={"TPU": 1},
)

trainer = TorchTrainer(
    train_loop_per_worker=train_fn_per_worker,
    scaling_config=scaling_config,
)

if __name__ == "__main__":
    import sys

    from tpuray.emulator import EmulatedCluster, SliceRequest

    topology = sys.argv[1] if len(sys.argv) > 1 else "4x4"
    if topology != "4x4":  # the same sample, on a smaller slice for small machines
        workers = {"2x2": 4, "2x4": 8}[topology]
        trainer = TorchTrainer(
            train_loop_per_worker=train_fn_per_worker,
            scaling_config=ScalingConfig(num_workers=workers, use_tpu=True, topology=topology,
                                         accelerator_type="TPU-V6E", resources_per_worker={"TPU": 1}),
        )
    print(f"tpuray: starting an EMULATED TPU v6e {topology} slice on this machine; Ray Train runs on it unchanged")
    with EmulatedCluster([SliceRequest("TPU-V6E", topology)], head_cpus=4) as cluster:
        cluster.connect()
        result = trainer.fit()
        print(result)
