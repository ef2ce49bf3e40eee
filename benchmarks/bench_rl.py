"""tpuray.rl weight sync against the raw object-store transfer of the same bytes, and the split of a GRPO
iteration (examples/rl_grpo.py), on two emulated v6e 2x2 slices it starts itself.

Weight sync: `RolloutEngine.update_weights(state_dict)` into a TP=2 rollout engine on the slice (checks
names and shapes, ray.put once, each worker pulls, cuts its shard and copies it into its tensors).
Anchor: the same state dict `ray.put` once and pulled by one task per engine worker on the slice's host
(what any object-store sync must at least do). Goal (issue 23): sync seconds <= 1.2x the anchor.

Iteration split: the GRPO example with its trainer on the driver (`--slice`), then on tpuray.train
(`--trainer tpuray`: FSDP2 on 2 workers of one slice, the rollout engine TP=2 on the other, RLRun) run
sequentially and with `--overlap`, then colocated (`--colocate`: one slice, the engine inside the
trainer's two workers, sleeping while they train), compared with the sequential disaggregated run.
Goals: sync < 10% of an iteration; overlap <= 0.7x sequential.

    .venv/bin/python benchmarks/bench_rl.py [--hidden 512] [--layers 4] [--rounds 5] [--iterations 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _puller_class():
    import ray

    @ray.remote(num_cpus=0)
    class Puller:
        def pull(self, state: dict) -> int:  # Ray resolves the ref before the call: the transfer is timed
            return sum(t.numel() * t.element_size() for t in state.values())

    return Puller


def bench_sync(args: argparse.Namespace) -> tuple[float, float, float, int]:
    """(median sync seconds, median pre-sharded sync seconds (put_shards + update_weights), median anchor
    seconds, bytes of the state dict)."""
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as root:
        return _bench_sync(args, Path(root))


def _bench_sync(args: argparse.Namespace, root: Path) -> tuple[float, float, float, int]:
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from transformers import AutoModelForCausalLM

    from tpuray.models import build_tiny_causal_lm
    from tpuray.rl import RolloutConfig, RolloutEngine, put_shards

    path = build_tiny_causal_lm(
        root / "m",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=128,
    )
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    cfg = RolloutConfig(
        str(path),
        accelerator_type="TPU-V6E",
        topology="2x2",
        chips_per_worker=2,
        max_model_len=64,
        max_num_seqs=4,
    )
    puller = _puller_class()
    with RolloutEngine(cfg) as engine:
        assert engine.group is not None
        nodes = engine.group.node_ids()
        ranks = engine.group.world_size
        pullers = [
            puller.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
            ).remote()
            for i in range(ranks)
        ]  # warm actors, like the engine's workers: the anchor pays no scheduling
        sync, sharded, raw = [], [], []
        for r in range(args.rounds + 1):  # round 0 warms both paths
            t = time.perf_counter()
            engine.update_weights(state)
            s = time.perf_counter() - t
            t = time.perf_counter()
            engine.update_weights(put_shards(state, engine.model_config, ranks))
            sh = time.perf_counter() - t
            t = time.perf_counter()
            ref = ray.put(state)
            got = ray.get([p.pull.remote(ref) for p in pullers])
            a = time.perf_counter() - t
            assert got == [nbytes] * ranks
            del ref
            if r:
                sync.append(s)
                sharded.append(sh)
                raw.append(a)
        for p in pullers:
            ray.kill(p)
    return statistics.median(sync), statistics.median(sharded), statistics.median(raw), nbytes


def bench_iterations(iterations: int, *extra: str) -> list:
    from tpuray.rl import grpo

    return grpo.run(grpo.parse_args(["--iterations", str(iterations), *extra]))


def print_split(title: str, history: list) -> float:
    """The median split of the steady iterations (the first pays start-up); returns the median
    iteration's wall time."""
    steady = history[1:] or history
    split = {
        k: statistics.median(getattr(it, k) for it in steady)
        for k in ("generate_s", "reward_s", "train_s", "sync_s", "total_s")
    }
    print(f"\n{title}, median of {len(steady)} iterations")
    print("| phase | seconds | share of the iteration |")
    print("|---|---|---|")
    for k, v in split.items():
        print(f"| {k[:-2]} | {v:.3f} | {v / split['total_s']:.0%} |")
    return split["total_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=10)
    args = ap.parse_args()

    import ray

    from tpuray.emulator import EmulatedCluster, SliceRequest

    cluster = EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=2).start()
    cluster.connect()
    try:
        sync, sharded, raw, nbytes = bench_sync(args)
        history = bench_iterations(args.iterations, "--slice")
        sequential = bench_iterations(args.iterations, "--trainer", "tpuray")
        overlapped = bench_iterations(args.iterations, "--trainer", "tpuray", "--overlap")
        colocated = bench_iterations(args.iterations, "--trainer", "tpuray", "--colocate")
    finally:
        ray.shutdown()
        cluster.shutdown()
    mb = nbytes / 1e6
    print(
        f"\nweight sync, {mb:.1f} MB fp32 state dict -> TP=2 rollout engine on an emulated v6e 2x2 (median of {args.rounds})"
    )
    print("| path | seconds | MB/s | ratio |")
    print("|---|---|---|---|")
    print(f"| RolloutEngine.update_weights | {sync:.3f} | {mb / sync:.0f} | {sync / raw:.2f} |")
    print(
        f"| put_shards + update_weights (each rank pulls its part) | {sharded:.3f} | {mb / sharded:.0f} | {sharded / raw:.2f} |"
    )
    print(f"| raw ray.put + one pull per worker | {raw:.3f} | {mb / raw:.0f} | 1.00 |")
    print(f"goal <= 1.2x: {'met' if min(sync, sharded) / raw <= 1.2 else 'not met'}")
    print_split("GRPO iteration split (examples/rl_grpo.py --slice: trainer on the driver's CPU)", history)
    seq = print_split(
        "RLRun, sequential (examples/rl_grpo.py --trainer tpuray: FSDP2 on 2 workers)", sequential
    )
    ovl = print_split("RLRun, overlap (--trainer tpuray --overlap, off-policy by one step)", overlapped)
    col = print_split(
        "RLRun, colocated (--trainer tpuray --colocate: one slice, the engine in the trainer's workers)",
        colocated,
    )
    sync_share = statistics.median(it.sync_s / it.total_s for it in sequential[1:] or sequential)
    print(
        f"\nsync share of a sequential RLRun iteration: {sync_share:.1%} (goal < 10%: {'met' if sync_share < 0.1 else 'not met'})"
    )
    print(
        f"overlap / sequential iteration: {ovl / seq:.2f}x (goal <= 0.7x: {'met' if ovl / seq <= 0.7 else 'not met'})"
    )
    print(f"colocated (one slice) / disaggregated (two slices) sequential iteration: {col / seq:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
