"""TorchTrainer fit time and per-report() overhead: tpuray.train vs Ray Train 2.60's own TorchTrainer on
the SAME emulated TPU slices (Ray's `use_tpu=True` path, which runs unchanged on tpuray's emulated hosts),
the seed's training loop on 4 workers (v6e 2x2) and 16 workers (v6e 4x4), in one run on one machine; plus
the earlier anchor, Ray Train on 4 CPU workers with gloo.

    .venv/bin/python benchmarks/bench_train.py [--reps 3] [--reps16 2] [--reports 50] [--reports16 10]

Prints medians and ratios (tpuray / Ray Train; < 1 means tpuray is faster). Figures only, no assertions.
Everything TPU here is EMULATED (CPU compute behind the tpu device, gloo behind tpu_dist).
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


def fit(
    api: str, loop, config: dict, storage: str, workers: int = 4, tpu: bool = True
) -> tuple[float, object]:
    """One fit: api "tpuray" (always on the emulated slice) or "ray" (use_tpu=`tpu`, else CPU + gloo)."""
    config = {**config, "api": api}
    name = f"bench_{api}_{time.time_ns()}"
    topology = {4: "2x2", 16: "4x4"}[workers]
    if api == "ray":
        import ray.train
        from ray.train.torch import TorchTrainer

        if tpu:
            scaling = ray.train.ScalingConfig(
                num_workers=workers,
                use_tpu=True,
                topology=topology,
                accelerator_type="TPU-V6E",
                resources_per_worker={"TPU": 1},
            )
        else:
            scaling = ray.train.ScalingConfig(num_workers=workers, use_gpu=False)
        trainer = TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=scaling,
            run_config=ray.train.RunConfig(storage_path=storage, name=name),
        )
    else:
        import tpuray.train
        from tpuray.train.torch import TorchTrainer

        trainer = TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=tpuray.train.ScalingConfig(
                num_workers=workers, use_tpu=True, topology=topology, accelerator_type="TPU-V6E"
            ),
            run_config=tpuray.train.RunConfig(storage_path=storage, name=name, verbose=0),
        )
    start = time.perf_counter()
    result = trainer.fit()
    if getattr(result, "error", None) is not None:
        raise RuntimeError(f"{api} fit failed: {result.error}")
    return time.perf_counter() - start, result


def _medians(args, storage: str, workers: int, reps: int, ray_tpu: bool) -> dict[str, float]:
    times: dict[str, list[float]] = {"tpuray": [], "ray": []}
    for rep in range(reps):
        for api in ("tpuray", "ray"):
            seconds, result = fit(api, seed_loop, {}, storage, workers, tpu=ray_tpu)
            times[api].append(seconds)
            where = "emulated TPU" if api == "tpuray" or ray_tpu else "CPU/gloo"
            print(
                f"  {workers:2d} workers rep {rep} {api:7s} ({where}) fit {seconds:6.2f}s  loss {result.return_value:.4f}"
            )
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="fits per trainer at 4 workers (alternating)")
    parser.add_argument("--reps16", type=int, default=2, help="fits per trainer at 16 workers")
    parser.add_argument("--reports", type=int, default=50, help="report() calls in the overhead run")
    parser.add_argument(
        "--reports16", type=int, default=10, help="report() calls in the 16-worker overhead run"
    )
    args = parser.parse_args()
    logging.getLogger("ray.train").setLevel(logging.WARNING)

    import ray

    from tpuray.emulator import EmulatedCluster, SliceRequest

    with (
        tempfile.TemporaryDirectory() as storage,
        EmulatedCluster(
            [SliceRequest("TPU-V6E", "2x2"), SliceRequest("TPU-V6E", "4x4")], head_cpus=4
        ) as cluster,
    ):
        cluster.connect(log_to_driver=False)
        print(f"cluster: {cluster.describe()} + CPU head (4 CPUs); os.cpu_count()={os.cpu_count()}")
        tpu4 = _medians(args, storage, 4, args.reps, ray_tpu=True)
        tpu16 = _medians(args, storage, 16, args.reps16, ray_tpu=True)
        cpu4 = _medians(args, storage, 4, args.reps, ray_tpu=False)
        per_report: dict[int, dict[str, float]] = {4: {}, 16: {}}
        for workers, n in ((4, args.reports), (16, args.reports16)):
            for api in ("tpuray", "ray"):
                _, result = fit(api, report_loop, {"n": n}, storage, workers, tpu=True)
                per_report[workers][api] = result.return_value
        ray.shutdown()

    print()
    print(f"{'metric':58s} {'tpuray':>9s} {'Ray Train':>10s} {'ratio':>7s}")
    rows = [
        ("fit, seed loop, 4 workers, same emulated v6e 2x2 (s)", tpu4),
        ("fit, seed loop, 16 workers, same emulated v6e 4x4 (s)", tpu16),
        ("fit, 4 workers: tpuray emulated 2x2 vs Ray on CPU/gloo (s)", cpu4),
    ]
    for name, med in rows:
        print(f"{name:58s} {med['tpuray']:9.2f} {med['ray']:10.2f} {med['tpuray'] / med['ray']:7.2f}")
    for workers, topology in ((4, "2x2"), (16, "4x4")):
        rep = per_report[workers]
        name = f"report() overhead, {workers} workers, emulated {topology} (ms/call)"
        print(
            f"{name:58s} {rep['tpuray'] * 1e3:9.3f} {rep['ray'] * 1e3:10.3f} {rep['tpuray'] / rep['ray']:7.3f}"
        )
    print(
        f"(medians of {args.reps} / {args.reps16} fits; Ray Train {ray.__version__} (V2) with use_tpu=True on the "
        f"same emulated slices; goal: fit ratio <= 0.5; os.cpu_count()={os.cpu_count()})"
    )


if __name__ == "__main__":
    main()
