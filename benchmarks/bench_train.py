"""TorchTrainer fit time and per-report() overhead: tpuray (emulated v6e 2x2 slice, tpu_dist) vs Ray Train
(CPU workers, gloo), the seed's training loop on 4 workers, in one run on one machine.

    .venv/bin/python benchmarks/bench_train.py [--reps 3] [--reports 200]

Prints medians and ratios (tpuray / Ray Train; < 1 means tpuray is faster). Figures only, no assertions.
Both trainers run on the same local Ray cluster: a CPU head (Ray Train's 4 workers) plus one emulated TPU
host (tpuray's 4 workers). The tpuray side is EMULATED TPU (CPU compute behind the tpu device).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

os.environ.setdefault("TPURAY_QUIET", "1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # Ray 2.60's default TorchTrainer


def seed_loop(config):
    """The seed's loop; `config["api"]` picks ray.train or tpuray.train."""
    import torch
    from torch import nn, optim

    if config["api"] == "ray":
        import ray.train as train
        import ray.train.torch as train_torch
    else:
        import tpuray.train as train
        import tpuray.train.torch as train_torch
    device = train_torch.get_device()
    model = train_torch.prepare_model(
        nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    )
    criterion = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    inputs = torch.randn(128, 10, device=device)
    targets = inputs.sum(dim=1, keepdim=True)
    for epoch in range(10):
        optimizer.zero_grad()
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        train.report({"loss": loss.item(), "epoch": epoch + 1})
    return loss.item()  # Ray Train V2 keeps metrics only with checkpoints: return the final loss


def report_loop(config):
    """`n` back-to-back report() calls (no training); returns rank 0's mean seconds per call."""
    if config["api"] == "ray":
        import ray.train as train
    else:
        import tpuray.train as train
    n = config["n"]
    start = time.perf_counter()
    for i in range(n):
        train.report({"step": i, "loss": 1.0 / (i + 1)})
    return (time.perf_counter() - start) / n


def fit(api: str, loop, config: dict, storage: str) -> tuple[float, object]:
    config = {**config, "api": api}
    name = f"bench_{api}_{time.time_ns()}"
    if api == "ray":
        import ray.train
        from ray.train.torch import TorchTrainer

        trainer = TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=4, use_gpu=False),
            run_config=ray.train.RunConfig(storage_path=storage, name=name),
        )
    else:
        import tpuray.train
        from tpuray.train.torch import TorchTrainer

        trainer = TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=tpuray.train.ScalingConfig(
                num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E"
            ),
            run_config=tpuray.train.RunConfig(storage_path=storage, name=name, verbose=0),
        )
    start = time.perf_counter()
    result = trainer.fit()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="fits per trainer (alternating)")
    parser.add_argument("--reports", type=int, default=50, help="report() calls in the overhead run")
    args = parser.parse_args()
    logging.getLogger("ray.train").setLevel(logging.WARNING)

    import ray

    from tpuray.emulator import EmulatedCluster, SliceRequest

    with (
        tempfile.TemporaryDirectory() as storage,
        EmulatedCluster([SliceRequest("TPU-V6E", "2x2")], head_cpus=4) as cluster,
    ):
        cluster.connect(log_to_driver=False)
        print(f"cluster: {cluster.describe()} + CPU head (4 CPUs); os.cpu_count()={os.cpu_count()}")
        fit_times: dict[str, list[float]] = {"tpuray": [], "ray": []}
        for rep in range(args.reps):
            for api in ("tpuray", "ray"):
                seconds, result = fit(api, seed_loop, {}, storage)
                fit_times[api].append(seconds)
                print(f"  rep {rep} {api:7s} fit {seconds:6.2f}s  final loss {result.return_value:.4f}")
        per_report = {}
        for api in ("tpuray", "ray"):
            _, result = fit(api, report_loop, {"n": args.reports}, storage)
            per_report[api] = result.return_value
        ray.shutdown()

    med = {k: statistics.median(v) for k, v in fit_times.items()}
    print()
    print(f"{'metric':34s} {'tpuray':>12s} {'Ray Train':>12s} {'ratio':>8s}")
    print(
        f"{'fit time, seed loop, 4 workers (s)':34s} {med['tpuray']:12.2f} {med['ray']:12.2f} "
        f"{med['tpuray'] / med['ray']:8.2f}"
    )
    print(
        f"{'report() overhead (ms/call)':34s} {per_report['tpuray'] * 1e3:12.3f} {per_report['ray'] * 1e3:12.3f} "
        f"{per_report['tpuray'] / per_report['ray']:8.3f}"
    )
    print(
        f"(median of {args.reps} fits each; tpuray on an EMULATED v6e 2x2 slice with tpu_dist, Ray Train "
        f"{ray.__version__} V2 on 4 CPU workers with gloo; goal: fit ratio <= 0.9; os.cpu_count()={os.cpu_count()})"
    )


if __name__ == "__main__":
    main()
