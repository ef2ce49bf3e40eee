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

Transports (`RLConfig(weight_sync=...)`): an RLRun per transport (FSDP2 trainer of 2 workers on one
slice, TP=2 engine on the other) sends the same weights every iteration; seconds per `rl.send` on trainer
rank 0 against the raw transfer of the same bytes between plain actors on the same hosts (object store:
ray.put + ray.get; tpu_dist: send / recv over a group made the same way). Where vLLM is installed, two
more RLRuns sync over each transport into vLLM TP=4 on the rollout slice (one vLLM worker per chip,
each taking only its part, cut in vLLM's layout: pulled, or received over the group it joins), against
the same raw transfer of the bytes its four ranks receive. `--only sync` stops there; `--only transports`
runs that table alone, for the `--weight-sync` and `--engine` values given (all by default).

Colocated engines (`--only colocated`, not part of `all`): colocated RLRuns (the engine TP=2 inside the
FSDP2 trainer's 2 workers on one slice), the trainer sending the same weights every iteration: the
embedded engine over each `--weight-sync` (object_store: pieces through the object store, owned by the
mailbox; tpu_dist: the in-process hand-over, `tpuray.rl.sync.handover`) at RLConfig(sleep_level=1), then 2,
then 1 again, and vLLM (its external launcher) over each at level 1; the medians of rollout (wake-up,
generate, sleep), sync and iteration seconds and the bytes sleep freed, side by side, and the ratios
(vLLM / embedded, tpu_dist / object_store, level 2 / level 1).

Overlap on cores of their own (`--only overlap`, not part of `all`): the sequential and the overlapped
RLRun (`--trainer tpuray`, then with `--overlap`) on two emulated slices that share the machine's cores
(as in `all`), then on two slices with cores of their own (`EmulatedCluster(cores="per_slice")`: each
slice's processes on half the cores, as a real slice computes on its own chips); the overlap / sequential
ratio for each, and the overlapped iteration on cores of their own against the sequential one on shared
cores (the wall time this machine gains, or loses).

The example's reward (`--only reward`, not part of `all`): `examples/rl_grpo.py` with its defaults (60
iterations, the engine in this process), its mean reward per iteration against the goal (>= 2x the
first iteration's, or >= 0.8).

    .venv/bin/python benchmarks/bench_rl.py [--hidden 512] [--layers 4] [--rounds 5] [--iterations 10]
                                            [--only all|sync|transports|colocated|overlap|reward]
                                            [--weight-sync object_store tpu_dist] [--engine embedded vllm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _rl_anchors  # noqa: E402
from _rl_anchors import bench_raw, puller_class  # noqa: E402


def bench_sync(args: argparse.Namespace) -> tuple[float, float, float, int]:
    """(median sync seconds, median pre-sharded sync seconds (put_shards + update_weights), median anchor
    seconds, bytes of the state dict)."""
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as root:
        return _bench_sync(args, Path(root))


def _model(args: argparse.Namespace, root: Path) -> Path:
    from tpuray.models import build_tiny_causal_lm

    return build_tiny_causal_lm(
        root / "m",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=128,
    )


def _bench_sync(args: argparse.Namespace, root: Path) -> tuple[float, float, float, int]:
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from transformers import AutoModelForCausalLM

    from tpuray.demo import grpo
    from tpuray.rl import put_shards, rollout_engine

    path = _model(args, root)
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    cfg, _ = grpo.two_slices(str(path), max_num_seqs=4)
    puller = puller_class()
    with rollout_engine(cfg) as engine:
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


# -- transports: object_store vs tpu_dist, from a tpuray.train run ----------------------------------------
def _send_loop(config: dict) -> list[float]:
    """An RLRun trainer (FSDP2 over its ranks) that sends the same weights every iteration; returns this
    rank's seconds per send (cut + transfer + the engine's check and commit, until the ack)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import tpuray.train.torch as tt
    from tpuray import train

    rl = config["rl"]
    model = AutoModelForCausalLM.from_pretrained(config["path"], dtype=torch.float32).to(tt.get_device())
    model = fully_shard(
        model, mesh=init_device_mesh(tt.get_device().type, (train.get_context().get_world_size(),))
    )
    seconds = []
    for k in range(rl.iterations):
        rl.batch(k)
        t = time.perf_counter()
        rl.send(model, version=k + 1)
        seconds.append(time.perf_counter() - t)
    return seconds


VLLM_ROWS = {"object_store": "object_store -> vLLM TP=4", "tpu_dist": "tpu_dist -> vLLM TP=4"}


def bench_transports(args: argparse.Namespace) -> dict[str, tuple[float, float, int]]:
    """For each weight_sync: (median seconds per sync seen by trainer rank 0, median raw transfer seconds
    of the same bytes between the same hosts, bytes per sync), FSDP2 trainer of 2 workers x 2 chips on
    one emulated v6e 2x2 -> TP=2 embedded rollout engine on the other; where vLLM is installed, also
    both into vLLM TP=4 (one vLLM worker per chip, each taking only its part)."""
    from tpuray.serve.llm.engine.vllm import vllm_available

    with tempfile.TemporaryDirectory(prefix="bench-rl-") as root:
        path = _model(args, Path(root))
        engines = [e for e in args.engine if e != "vllm" or vllm_available()]
        runs = [
            (transport if engine == "embedded" else VLLM_ROWS[transport], transport, engine)
            for engine in engines
            for transport in args.weight_sync
        ]
        out = {}
        for row, transport, engine in runs:
            seconds, nbytes, senders, tp = _sync_run(path, transport, args.rounds, engine)
            share = nbytes // (senders * tp) // 4  # FSDP2 Shard(0): each rank holds about half of each part
            raw = bench_raw([[share * 4] * tp for _ in range(senders)], args.rounds)
            out[row] = (seconds, raw[transport], nbytes)
        return out


def _sync_run(path: Path, transport: str, rounds: int, engine: str) -> tuple[float, int, int, int]:
    from tpuray.demo import grpo
    from tpuray.rl import RLConfig, RLRun, RolloutConfig
    from tpuray.train import RunConfig

    rollout, trainer = grpo.two_slices(str(path), max_num_seqs=4)
    if engine == "vllm":  # one vLLM worker per chip of the same slice (vLLM takes one chip per worker)
        rollout = RolloutConfig(
            str(path), "TPU-V6E", "2x2", engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32"
        )
    with tempfile.TemporaryDirectory(prefix="bench-rl-run-") as storage:
        result = RLRun(
            RLConfig(rollout, trainer, weight_sync=transport),  # type: ignore[arg-type]
            _send_loop,
            train_loop_config={"path": str(path)},
            run_config=RunConfig(storage_path=f"file://{storage}", name=f"sync-{transport}-{engine}"),
        ).run(rounds + 1, lambda _rollout_engine, k: k)
    last = result.times[-1]
    seconds = statistics.median(result.train_result.return_value[1:])  # the first send joins / warms
    return seconds, last.sync_bytes, last.senders, rollout.tensor_parallel_size


def bench_colocated(args: argparse.Namespace) -> dict[str, tuple[float, float, float, int]]:
    """For each engine (embedded; vLLM where installed): medians over the steady iterations of a colocated
    RLRun (an FSDP2 trainer on the 2 workers x 2 chips of one emulated v6e 2x2 sends the same weights
    every iteration; the engine, TP=2, runs in those workers): (rollout seconds: wake-up, generating 8
    sequences of 16 tokens and sleep; sync seconds; iteration seconds; bytes sleep freed)."""
    from tpuray.demo import grpo
    from tpuray.rl import RLConfig, RLRun, RolloutConfig
    from tpuray.serve.llm.engine.vllm import vllm_available
    from tpuray.serve.llm.generation import SamplingParams
    from tpuray.train import RunConfig

    def rollout_fn(engine: Any, k: int) -> int:
        engine.generate(
            ["1 + 2 ="] * 8, SamplingParams(max_tokens=16, temperature=1.0, seed=k, ignore_eos=True)
        )
        return k

    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as root:
        path = str(_model(args, Path(root)))
        _, trainer = grpo.two_slices(path, max_num_seqs=8)
        engines = [e for e in args.engine if e != "vllm" or vllm_available()]
        # the embedded engine over each transport at sleep_level 1, then 2, then 1 again (alternated);
        # vLLM over each transport at level 1 (its CPU backend keeps the weights in host memory)
        embedded = [("embedded", level, t) for level in (1, 2, 1) for t in args.weight_sync]
        setups = (embedded[: len(args.weight_sync)] if "embedded" in engines else []) + (
            [("vllm", 1, t) for t in args.weight_sync] if "vllm" in engines else []
        )
        setups += embedded[len(args.weight_sync) :] if "embedded" in engines else []
        for n, (engine, level, transport) in enumerate(setups):
            rollout = RolloutConfig(path, engine=engine, max_model_len=64, max_num_seqs=8, dtype="float32")
            config = RLConfig(
                rollout,
                trainer,
                placement="colocated",
                weight_sync=transport,  # type: ignore[arg-type]
                sleep_level=level,  # type: ignore[arg-type]
            )
            with tempfile.TemporaryDirectory(prefix="bench-rl-run-") as storage:
                result = RLRun(
                    config,
                    _send_loop,
                    train_loop_config={"path": path},
                    run_config=RunConfig(storage_path=f"file://{storage}", name=f"colocated-{engine}-{n}"),
                ).run(args.rounds + 1, rollout_fn)
            steady = result.times[1:]  # the first iteration pays the engine's start
            label = f"{engine}, {transport}, sleep_level={level}"
            out[label if label not in out else f"{label} (again)"] = (
                statistics.median(t.rollout for t in steady),
                statistics.median(t.sync for t in steady),
                statistics.median(t.total for t in steady),
                int(statistics.median(t.freed for t in steady)),
            )
    return out


def print_colocated(results: dict[str, tuple[float, float, float, int]], rounds: int) -> None:
    print(f"\ncolocated RLRun per engine (TP=2 in the trainer's 2 workers), median of {rounds} iterations")
    print("| engine | rollout (wake, generate 8x16, sleep) s | sync s | iteration s | freed by sleep MB |")
    print("|---|---|---|---|---|")
    for engine, (rollout, sync, total, freed) in results.items():
        print(f"| {engine} | {rollout:.3f} | {sync:.3f} | {total:.3f} | {freed / 1e6:.1f} |")
    level1 = {t: _mean_of(results, f"embedded, {t}, sleep_level=1") for t in ("object_store", "tpu_dist")}
    vllm = {t: results.get(f"vllm, {t}, sleep_level=1") for t in ("object_store", "tpu_dist")}
    for transport, row in vllm.items():
        if row is not None and level1[transport] is not None:
            print(f"vLLM / embedded colocated iteration ({transport}): {row[2] / level1[transport]:.2f}x")
    if vllm["object_store"] is not None and vllm["tpu_dist"] is not None:
        ratio = vllm["tpu_dist"][2] / vllm["object_store"][2]
        print(f"vLLM colocated iteration, tpu_dist (in-process hand-over) / object_store: {ratio:.2f}x")
    if level1["object_store"] is not None and level1["tpu_dist"] is not None:
        ratio = level1["tpu_dist"] / level1["object_store"]
        print(
            f"embedded colocated iteration, tpu_dist (in-process hand-over) / object_store, level 1: {ratio:.2f}x"
        )
    for transport, mean in level1.items():
        level2 = results.get(f"embedded, {transport}, sleep_level=2")
        if mean is not None and level2 is not None:
            print(
                f"embedded colocated iteration over {transport}, sleep_level=2 / 1 (mean of the two level-1 "
                f"runs): {level2[2] / mean:.2f}x"
            )


def _mean_of(results: dict[str, tuple[float, float, float, int]], label: str) -> float | None:
    """The mean iteration seconds of a setup's runs (`label` and `label (again)`), None if it did not run."""
    runs = [results[k][2] for k in (label, f"{label} (again)") if k in results]
    return statistics.mean(runs) if runs else None


def bench_iterations(iterations: int, *extra: str) -> list:
    from tpuray.demo import grpo

    return grpo.run(grpo.parse_args(["--iterations", str(iterations), *extra]))


def print_reward(history: list) -> None:
    """The example's reward over its run against issue 23's goal: >= 2x the first iteration's mean, or
    >= 0.8, within the iterations it runs."""
    means = [it.mean_reward for it in history]
    goal = min(2 * means[0], 0.8)
    reached = next((i for i, m in enumerate(means) if m >= goal), None)
    print(f"\nGRPO example's mean reward over {len(means)} iterations (examples/rl_grpo.py, its defaults)")
    print(
        f"first iteration {means[0]:.3f}, last {means[-1]:.3f}, last 12 {statistics.fmean(means[-12:]):.3f}"
    )
    verdict = f"met at iteration {reached}" if reached is not None else "not met"
    print(
        f"goal >= {goal:.3f} (2x the first, or 0.8): {verdict}; {sum(m >= goal for m in means)} of {len(means)} at or above it"
    )


def bench_overlap(iterations: int) -> dict[str, tuple[list, list]]:
    """Sequential and overlapped RLRun histories on two emulated v6e 2x2 slices, by `cores` setting: the
    slices sharing every core, then each on cores of its own."""
    import ray

    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.emulator.spec import SLICE_CORES

    out = {}
    for cores in SLICE_CORES:
        two = [SliceRequest("TPU-V6E", "2x2", count=2)]
        cluster = EmulatedCluster(two, head_cpus=2, cores=cores).start()
        cluster.connect()
        try:
            sequential = bench_iterations(iterations, "--trainer", "tpuray")
            overlapped = bench_iterations(iterations, "--trainer", "tpuray", "--overlap")
        finally:
            ray.shutdown()
            cluster.shutdown()
        out[cores] = (sequential, overlapped)
    return out


def print_overlap(runs: dict[str, tuple[list, list]]) -> None:
    totals = {}
    for cores, (sequential, overlapped) in runs.items():
        seq = print_split(f"RLRun, sequential, cores={cores!r}", sequential)
        totals[cores] = (seq, print_split(f"RLRun, overlap, cores={cores!r}", overlapped))
    print()
    for cores, (seq, ovl) in totals.items():
        verdict = "met" if ovl / seq <= 0.7 else "not met"
        print(f"overlap / sequential iteration, cores={cores!r}: {ovl / seq:.2f}x (goal <= 0.7x: {verdict})")
    ovl_own, seq_shared = totals["per_slice"][1], totals["shared"][0]
    print(
        f"overlapped on cores of their own / sequential on shared cores: {ovl_own / seq_shared:.2f}x "
        "(wall time on this machine: each slice has a share of its cores)"
    )


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


def print_sync(sync: float, sharded: float, raw: float, nbytes: int, rounds: int) -> None:
    mb = nbytes / 1e6
    print(
        f"\nweight sync, {mb:.1f} MB fp32 state dict -> TP=2 rollout engine on an emulated v6e 2x2 (median of {rounds})"
    )
    print("| path | seconds | MB/s | ratio |")
    print("|---|---|---|---|")
    print(f"| RolloutEngine.update_weights | {sync:.3f} | {mb / sync:.0f} | {sync / raw:.2f} |")
    print(
        f"| put_shards + update_weights (each rank pulls its part) | {sharded:.3f} | {mb / sharded:.0f} | {sharded / raw:.2f} |"
    )
    print(f"| raw ray.put + one pull per worker | {raw:.3f} | {mb / raw:.0f} | 1.00 |")
    print(f"goal <= 1.2x: {'met' if min(sync, sharded) / raw <= 1.2 else 'not met'}")


def print_transports(results: dict[str, tuple[float, float, int]], rounds: int) -> None:
    if not results:
        print("\nweight sync from tpuray.train: no row ran (--engine vllm only, and vLLM is not installed)")
        return
    mb = next(iter(results.values()))[2] / 1e6  # the TP=2 engine's ranks receive the weights once
    print(
        f"\nweight sync from tpuray.train (FSDP2, 2 workers x 2 chips, emulated v6e 2x2) -> rollout engine on "
        f"another emulated v6e 2x2: {mb:.1f} MB of weights, seconds per sync on trainer rank 0 (median of {rounds}); "
        "MB/s and the raw transfer count the bytes the rollout ranks received"
    )
    print("| weight_sync | sync s | MB/s | raw transfer of the same bytes, s | ratio to raw |")
    print("|---|---|---|---|---|")
    for transport, (sync, raw, got) in results.items():
        print(f"| {transport} | {sync:.3f} | {got / 1e6 / sync:.0f} | {raw:.3f} | {sync / raw:.2f} |")
    best = min(results, key=lambda t: results[t][0])
    print(
        f"faster: {best}; goal <= 1.2x raw: "
        + ", ".join(f"{t} {'met' if s / r <= 1.2 else 'not met'}" for t, (s, r, _) in results.items())
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512, help="the local model's hidden size (46 MB at 512)")
    ap.add_argument("--layers", type=int, default=4, help="the local model's layers")
    ap.add_argument("--rounds", type=int, default=5, help="timed syncs per row (one more warms up)")
    ap.add_argument("--iterations", type=int, default=10, help="GRPO iterations per iteration-split run")
    ap.add_argument(
        "--only",
        choices=("all", "sync", "transports", "colocated", "overlap", "reward"),
        default="all",
        help="sync: the weight-sync tables only (no GRPO runs); transports: the RLRun transports table only; "
        "colocated: the colocated RLRun per engine only; overlap: sequential vs overlapped RLRun on shared "
        "cores, then with each slice on cores of its own; reward: the GRPO example's reward goal",
    )
    ap.add_argument(
        "--weight-sync",
        nargs="+",
        choices=("object_store", "tpu_dist"),
        default=["object_store", "tpu_dist"],
        help="transports table: these RLConfig.weight_sync values (default: both)",
    )
    ap.add_argument(
        "--engine",
        nargs="+",
        choices=("embedded", "vllm"),
        default=["embedded", "vllm"],
        help="transports and colocated tables: these rollout engines (default: both; vllm where installed)",
    )
    args = ap.parse_args()

    import ray
    import ray.cloudpickle

    from tpuray.emulator import EmulatedCluster, SliceRequest

    ray.cloudpickle.register_pickle_by_value(_rl_anchors)  # its actors go to the workers by value
    if args.only == "overlap":
        print_overlap(bench_overlap(args.iterations))
        return 0
    if args.only == "reward":  # the example in this process, as `python examples/rl_grpo.py` runs it
        from tpuray.demo import grpo

        print_reward(grpo.run(grpo.parse_args([])))
        return 0

    cluster = EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=2).start()
    cluster.connect()
    try:
        if args.only == "transports":
            print_transports(bench_transports(args), args.rounds)
            return 0
        if args.only == "colocated":
            print_colocated(bench_colocated(args), args.rounds)
            return 0
        sync, sharded, raw, nbytes = bench_sync(args)
        transports = bench_transports(args)
        print_transports(transports, args.rounds)
        if args.only == "sync":
            print_sync(sync, sharded, raw, nbytes, args.rounds)
            return 0
        history = bench_iterations(args.iterations, "--slice")
        sequential = bench_iterations(args.iterations, "--trainer", "tpuray")
        overlapped = bench_iterations(args.iterations, "--trainer", "tpuray", "--overlap")
        colocated = bench_iterations(args.iterations, "--trainer", "tpuray", "--colocate")
    finally:
        ray.shutdown()
        cluster.shutdown()
    print_sync(sync, sharded, raw, nbytes, args.rounds)
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
