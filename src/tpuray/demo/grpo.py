"""GRPO on a tiny local model with a verifiable reward: reply in exactly N words — the loop behind
`examples/rl_grpo.py` and `tpuray demo --rl` (a toy that shows the substrate at work, not an RL
algorithm library). `run(parse_args(argv))` runs it; with `--slice` or `--trainer tpuray` in a Ray
cluster with TPU v6e 2x2 slices that the caller connected to (the example starts an emulated one).

Usage (every option): `python examples/rl_grpo.py --help`.

Each iteration: the rollout engine (`tpuray.rl.rollout_engine`) samples a group of replies per prompt with
their logprobs; the reward is 1 for exactly N words, less the further the count is from N; GRPO's
advantage is the reward's z-score within its group; the trainer (plain PyTorch on this process's CPU:
the same Hugging Face model the engine serves) takes one clipped policy-gradient step; the new weights
go to the engine with `update_weights` (checked, then put once in Ray's object store and cut into each
tensor-parallel rank's shard on a slice). With `--trainer tpuray` the trainer is FSDP2 on tpuray.train's
workers instead, and the weights go through `RLRun`'s sync (`weight_sync="tpu_dist"`; colocated, the
in-process hand-over). The first line of each iteration's output shows the mean
reward rising; `logp_gap` is the largest gap between the engine's and the trainer's logprobs of the same
tokens (the weights the engine samples with are the trainer's).

The model is built locally by `tpuray.models.build_tiny_causal_lm` (random weights, no download).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = ["Tell me about the sea", "Describe a cat", "What is a tree", "Say something"]


def reward(text: str, words: int) -> float:
    """1.0 for exactly `words` words, falling linearly to 0 at 0 or 2 x words."""
    return max(0.0, 1.0 - abs(len(text.split()) - words) / words)


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO: each reward's z-score within its group of `group` samples of one prompt."""
    out = []
    for g in range(0, len(rewards), group):
        rs = rewards[g : g + group]
        mean, std = statistics.fmean(rs), statistics.pstdev(rs)
        out += [(r - mean) / (std + 1e-4) for r in rs]
    return out


def policy_step(model, optimizer, rollouts, advantages, clip: float = 0.2) -> tuple[float, float]:
    """One clipped-surrogate step over the batch (sequence-mean of token terms); returns (loss, the
    largest |trainer logprob - engine logprob| of the sampled tokens before the step)."""
    import torch

    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    logits = model(ids.to(next(model.parameters()).device)).logits.float().cpu()
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    losses, gap = [], 0.0
    for i, r in enumerate(rollouts):
        if not r.token_ids:
            continue
        start = len(r.prompt_token_ids) - 1
        logp = logp_all[i, start : start + len(r.token_ids)]
        old = torch.tensor(r.logprobs)
        gap = max(gap, float((logp.detach() - old).abs().max()))
        ratio = torch.exp(logp - old)
        adv = torch.tensor(advantages[i])
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        losses.append(-surrogate.mean())
    loss = torch.stack(losses).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach()), gap


@dataclass
class Iteration:
    """One GRPO iteration: its mean reward and where its time went (seconds)."""

    mean_reward: float
    generate_s: float
    reward_s: float
    train_s: float
    sync_s: float
    sync_bytes: int
    total_s: float = 0.0  # wall time of the iteration (the phases may overlap)


def run(args: argparse.Namespace) -> list[Iteration]:
    """The GRPO loop; returns every iteration's mean reward and time split."""
    with tempfile.TemporaryDirectory(prefix="rl-grpo-") as workdir:  # the model, removed afterwards
        return _run(args, Path(workdir))


def _run(args: argparse.Namespace, workdir: Path) -> list[Iteration]:
    import torch

    from tpuray.models import build_tiny_causal_lm

    torch.manual_seed(args.seed)
    path = str(build_tiny_causal_lm(workdir / "policy", max_position_embeddings=256, seed=args.seed))
    if args.trainer == "tpuray":
        return run_on_trainer(args, path)
    return run_on_driver(args, path)


def run_on_driver(args: argparse.Namespace, path: str) -> list[Iteration]:
    """GRPO with the trainer in this process (plain PyTorch on the CPU), the rollout engine here or
    (`--slice`) tensor parallel on a v6e 2x2 slice; `--colocate`: it sleeps while the trainer steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from tpuray.rl import RolloutConfig, rollout_engine

    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    config = RolloutConfig(
        path,
        accelerator_type="TPU-V6E" if args.slice else None,
        topology="2x2" if args.slice else None,
        chips_per_worker=2 if args.slice else 1,
        max_model_len=64,
        max_num_seqs=len(PROMPTS) * args.group,
    )
    history: list[Iteration] = []
    with rollout_engine(config) as engine:
        print(
            f"rollout engine: tensor_parallel_size={engine.tensor_parallel_size} on {engine.describe()['slice']}"
        )
        for it in range(args.iterations):
            iteration, rollouts = _iteration(args, it, engine, policy, optimizer)
            history.append(iteration)
        print("sample:", repr(rollouts[0].text))
    return history


def _iteration(
    args: argparse.Namespace, it: int, engine: Any, policy: Any, optimizer: Any
) -> tuple[Iteration, list]:
    """One iteration on the driver: generate, reward, train, sync; printed, and its rollouts."""
    from tpuray.serve.llm.generation import SamplingParams

    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 1000 + it)
    rollouts = engine.generate(PROMPTS, params, n=args.group)  # each prompt's group in turn
    t1 = time.perf_counter()
    rewards = [reward(r.text, args.words) for r in rollouts]
    advantages = group_advantages(rewards, args.group)
    t2 = time.perf_counter()
    if args.colocate:  # hand the chips' memory to the trainer for its step
        engine.sleep()
    loss, gap = policy_step(policy, optimizer, rollouts, advantages)
    for _ in range(args.epochs - 1):  # more clipped steps on the same rollouts (PPO-style)
        loss, _ = policy_step(policy, optimizer, rollouts, advantages)
    t3 = time.perf_counter()
    stats = engine.update_weights(policy.state_dict())  # asleep: into the host copy
    if args.colocate:
        engine.wake_up()
    t4 = time.perf_counter()
    mean = statistics.fmean(rewards)
    print(
        f"iter {it:3d}  mean_reward {mean:.3f}  loss {loss:+.4f}  logp_gap {gap:.1e}  "
        f"generate {t1 - t0:.2f}s reward {t2 - t1:.3f}s train {t3 - t2:.2f}s "
        f"sync {t4 - t3:.2f}s ({stats.bytes_written / 1e6:.1f} MB)",
        flush=True,
    )
    return Iteration(mean, t1 - t0, t2 - t1, t3 - t2, t4 - t3, stats.bytes_written, t4 - t0), rollouts


def grpo_train_loop(config: dict) -> None:  # runs on tpuray.train workers (imported there by name)
    """The trainer of `--trainer tpuray`: every tpuray.train rank holds an FSDP2 shard of the policy,
    takes each batch of rollouts, steps and sends its shard of the new weights (tpuray.rl.RLRun)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import tpuray.train.torch as tt
    from tpuray import train

    rl, device = config["rl"], tt.get_device()
    torch.manual_seed(config["seed"])
    policy = AutoModelForCausalLM.from_pretrained(config["path"], dtype=torch.float32).to(device)
    fully_shard(policy, mesh=init_device_mesh(device.type, (train.get_context().get_world_size(),)))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config["lr"], weight_decay=0.0)
    for k in range(rl.iterations):
        rollouts, advantages = rl.batch(k)
        t = time.perf_counter()
        for _ in range(config["epochs"]):  # every rank steps on the whole batch (a tiny one)
            loss, _ = policy_step(policy, optimizer, rollouts, advantages)
        train.report({"loss": loss, "train_s": time.perf_counter() - t})
        rl.send(policy, version=k + 1)


def two_slices(path: str, max_num_seqs: int) -> tuple[Any, Any]:
    """(RolloutConfig, ScalingConfig) of the `--trainer tpuray` layout: the rollout engine TP=2 on one
    emulated v6e 2x2 slice, the trainer's 2 workers x 2 chips on another."""
    from tpuray.rl import RolloutConfig
    from tpuray.train import ScalingConfig

    rollout = RolloutConfig(
        path, "TPU-V6E", "2x2", chips_per_worker=2, max_model_len=64, max_num_seqs=max_num_seqs
    )
    trainer = ScalingConfig(
        num_workers=2,
        use_tpu=True,
        topology="2x2",
        accelerator_type="TPU-V6E",
        resources_per_worker={"TPU": 2},
    )
    return rollout, trainer


def rl_config(args: argparse.Namespace, path: str) -> Any:
    """The `RLConfig` of `--trainer tpuray`: `two_slices` (disaggregated, weight_sync "tpu_dist"), or with
    `--colocate` the trainer's slice of it alone, the engine (TP=2) in its two workers (weight_sync
    "tpu_dist": each rank hands its engine rank its shards in process)."""
    import dataclasses

    from tpuray.rl import RLConfig

    rollout, trainer = two_slices(path, max_num_seqs=64)
    if not args.colocate:
        return RLConfig(rollout, trainer, overlap=args.overlap)
    on_trainer = dataclasses.replace(rollout, accelerator_type=None, topology=None, chips_per_worker=1)
    return RLConfig(on_trainer, trainer, placement="colocated")


def run_on_trainer(args: argparse.Namespace, path: str) -> list[Iteration]:
    """GRPO with the trainer on tpuray.train (2 workers x 2 chips, FSDP2) on one slice and the rollout
    engine (TP=2) on another: `tpuray.rl.RLRun`, disaggregated, `--overlap` off-policy by one step;
    `--colocate`: one slice, the engine inside the trainer's two workers, sleeping while they train."""
    from tpuray.rl import RLRun, RolloutEngine
    from tpuray.serve.llm.generation import SamplingParams
    from tpuray.train import RunConfig

    split: list[tuple[float, float, float]] = []

    def rollout_fn(engine: RolloutEngine, k: int) -> tuple:
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 1000 + k)
        rollouts = engine.generate(PROMPTS, params, n=args.group)
        t1 = time.perf_counter()
        rewards = [reward(r.text, args.words) for r in rollouts]
        split.append((statistics.fmean(rewards), t1 - t0, time.perf_counter() - t1))
        return rollouts, group_advantages(rewards, args.group)

    config = {"path": path, "lr": args.lr, "epochs": args.epochs, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="rl-grpo-run-") as storage:
        run = RLRun(
            rl_config(args, path),
            grpo_train_loop,
            train_loop_config=config,
            run_config=RunConfig(storage_path=storage, name="grpo", verbose=0),
        )
        result = run.run(args.iterations, rollout_fn)
    history = []
    trained = [m["train_s"] for m in result.train_result.metrics_history]
    for k, stats in enumerate(result.times):
        mean, gen, rew = split[k]
        history.append(Iteration(mean, gen, rew, trained[k], stats.sync, stats.sync_bytes, stats.total))
        print(
            f"iter {k:3d}  mean_reward {mean:.3f}  generate {gen:.2f}s reward {rew:.3f}s train {trained[k]:.2f}s "
            f"sync {stats.sync:.2f}s ({stats.sync_bytes / 1e6:.1f} MB)  iteration {stats.total:.2f}s",
            flush=True,
        )
    return history


def parser() -> argparse.ArgumentParser:
    """The loop's options (`parse_args` checks how they combine)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--iterations", type=int, default=60, help="GRPO iterations (generate, reward, train, sync)"
    )
    p.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--words", type=int, default=3, help="the reward's target word count N")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens sampled per reply at most")
    p.add_argument("--epochs", type=int, default=4, help="clipped policy steps per batch of rollouts")
    p.add_argument("--lr", type=float, default=1e-2, help="the policy optimizer's learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights, training and sampling")
    p.add_argument("--slice", action="store_true", help="rollout engine on an emulated v6e 2x2 slice")
    p.add_argument(
        "--colocate",
        action="store_true",
        help="sleep the rollout engine while the trainer steps (chip hand-over); with --trainer tpuray: "
        "RLConfig(placement='colocated'), one slice, the engine inside the trainer's workers",
    )
    p.add_argument(
        "--trainer",
        choices=("driver", "tpuray"),
        default="driver",
        help="driver: plain PyTorch in this process; tpuray: tpuray.train (FSDP2, 2 workers) on one emulated "
        "v6e 2x2 slice, the rollout engine on another (tpuray.rl.RLRun)",
    )
    p.add_argument(
        "--overlap", action="store_true", help="--trainer tpuray: generate the next batch while training"
    )
    return p


def parse_args(argv: list[str] | None = None, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """`argv` parsed by `p` (`parser()` by default, or one that adds options to it), the loop's options
    checked: SystemExit naming a value or combination that is invalid."""
    p = p or parser()
    args = p.parse_args(argv)
    for name in ("iterations", "group", "words", "max_tokens", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; valid: >= 1")
    if args.trainer == "tpuray" and args.slice:
        p.error(
            "--trainer tpuray places both sides itself (two slices, or one with --colocate); drop --slice"
        )
    if args.overlap and args.colocate:
        p.error("--overlap and --colocate exclude each other (colocated phases take turns on the chips)")
    if args.overlap and args.trainer != "tpuray":
        p.error("--overlap needs --trainer tpuray (a trainer that runs while the engine generates)")
    return args
