# ruff: noqa: E302, E305, F401, I001  (the seed sample kept verbatim, only ray.train renamed)
# fmt: off
"""The seed's TorchTrainer sample, with only `ray.train` -> `tpuray.train` renamed.

Run it anywhere:  .venv/bin/python examples/train_seed.py
Without RAY_ADDRESS it starts an *emulated* TPU v6e 4x4 slice (4 emulated hosts x 4 chips, real Ray nodes
on this machine) and trains on 16 workers over the emulated `tpu_dist` backend. With RAY_ADDRESS set
(e.g. a KubeRay cluster with a real v6e 4x4 slice), it connects there and runs on real TPUs.

Renames from the seed: `from ray import train` -> `from tpuray import train`, `ray.train.X` ->
`tpuray.train.X` (so `import tpuray` sits next to `import ray`). Everything else is the seed verbatim.
"""

import ray
import tpuray
from tpuray import train
from tpuray.train import ScalingConfig
from tpuray.train.torch import TorchTrainer
import torch
from torch import nn, optim
import torch.distributed as dist

def train_fn_per_worker(config):
    # Automatically resolves to torch.device("tpu") on TPU workers
    device = tpuray.train.torch.get_device()

    model = nn.Sequential(
        nn.Linear(10, 32),
        nn.ReLU(),
        nn.Linear(32, 1),
    ).to(device)

    # Wraps the model in DDP over the "tpu_dist" backend
    model = tpuray.train.torch.prepare_model(model)

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
    import os

    from tpuray.emulator import EmulatedCluster, SliceRequest

    cluster = None
    if not os.environ.get("RAY_ADDRESS"):
        print("tpuray: no RAY_ADDRESS; starting an EMULATED TPU v6e 4x4 slice (4 hosts x 4 chips) on this machine")
        cluster = EmulatedCluster([SliceRequest("TPU-V6E", "4x4")], head_cpus=2).start()
        cluster.connect()
    try:
        result = trainer.fit()
        for m in result.metrics_history:
            print(f"epoch {m['epoch']:2d}  loss {m['loss']:.4f}")
        print(result)
    finally:
        if cluster is not None:
            cluster.shutdown()
