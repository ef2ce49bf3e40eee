"""GRPO on a tiny local model with a verifiable reward (reply in exactly N words), on tpuray.rl.

    python examples/rl_grpo.py                       # rollout engine in this process (CPU)
    python examples/rl_grpo.py --slice               # rollout engine TP=2 on an emulated v6e 2x2 slice
    python examples/rl_grpo.py --colocate            # the engine sleeps (frees its memory) while training
    python examples/rl_grpo.py --trainer tpuray      # trainer: tpuray.train FSDP2 on a 2nd slice (RLRun)
    python examples/rl_grpo.py --trainer tpuray --overlap   # generate batch k+1 while training on k
    python examples/rl_grpo.py --trainer tpuray --colocate  # one slice: the engine in the trainer's workers
    python examples/rl_grpo.py --png reward.png      # and plot the mean reward per iteration

The loop (rollouts with logprobs -> reward -> group z-score advantages -> clipped policy steps -> weight
sync) lives in `tpuray.demo.grpo` (src/tpuray/demo/grpo.py), so that `tpuray demo --rl` runs the same code
from an installed package; read it there. This script adds where it runs: the emulated slices it starts
(or `--address`, a cluster of yours) and the plot.
"""

from __future__ import annotations

import argparse
import statistics

from tpuray.demo import grpo
from tpuray.emulator.spec import SLICE_CORES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The loop's options (`grpo.parser`) and this script's: the cluster and the plot."""
    p = grpo.parser()
    p.add_argument("--address", default=None, help="an existing Ray cluster with a v6e 2x2 slice")
    p.add_argument(
        "--cores",
        choices=SLICE_CORES,
        default="shared",
        help="the emulated slices it starts (--slice, --trainer tpuray) compute on every core (shared), or "
        "each on cores of its own (per_slice: as real slices on their own chips, so that --overlap's two "
        "phases do not slow each other down)",
    )
    p.add_argument("--png", default=None, help="plot the mean reward per iteration to this file")
    args = grpo.parse_args(argv, p)
    if args.cores != "shared" and (args.address or not (args.slice or args.trainer == "tpuray")):
        p.error(
            f"--cores {args.cores} applies to the emulated slices this example starts (--slice or "
            "--trainer tpuray, without --address)"
        )
    return args


def plot(means: list[float], png: str) -> None:
    from tpuray.optional import require

    matplotlib = require("matplotlib", "plot", "examples/rl_grpo.py --png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(means)), means, marker="o")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on a tiny model: reply in exactly N words")
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def start_cluster(args: argparse.Namespace):
    """Connect to the slices the loop needs (--slice, --trainer tpuray): `--address`'s cluster, or emulated
    v6e 2x2 slices started here (returned, to shut down; None otherwise)."""
    if not (args.slice or args.trainer == "tpuray"):
        return None
    import ray

    if args.address:
        ray.init(address=args.address)
        return None
    from tpuray.emulator import EmulatedCluster, SliceRequest

    slices = 2 if args.trainer == "tpuray" else 1
    cluster = EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=slices)], head_cpus=2, cores=args.cores)
    cluster.start()
    cluster.connect()
    return cluster


def main(argv: list[str] | None = None) -> list[grpo.Iteration]:
    args = parse_args(argv)
    cluster = start_cluster(args)
    try:
        history = grpo.run(args)
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    means = [it.mean_reward for it in history]
    k = max(1, len(means) // 5)
    print(
        f"mean reward: first {k} iterations {statistics.fmean(means[:k]):.3f}, last {k} {statistics.fmean(means[-k:]):.3f}"
    )
    if args.png:
        plot(means, args.png)
    return history


if __name__ == "__main__":
    main()
