"""`tpuray demo`: train a tiny LM on an emulated TPU slice, serve it, ask it a question."""

from __future__ import annotations

import argparse

from tpuray.cli.flags import add_slice_shape


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job: train on an emulated TPU slice, then serve (OpenAI API)",
        description=(
            "Starts an EMULATED TPU slice on this machine (real Ray nodes, CPU-backed tpu devices), trains a "
            "tiny causal LM with tpuray's TorchTrainer (DDP over tpu_dist), saves it in Hugging Face format, "
            "serves it with build_openai_app, sends one chat completion with the openai client, prints the "
            "answer and shuts everything down."
        ),
        epilog="example: tpuray demo --epochs 60 --question 'What is tpuray?'   (add --rl for the GRPO act)",
    )
    add_slice_shape(p, accelerator_type="TPU-V6E", topology="2x2")
    p.add_argument("--epochs", type=int, default=60, help="training epochs (default 60)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--question", default="What is tpuray?", help="the chat message to send")
    p.add_argument("--workdir", default=None, help="where the model and checkpoints go (default: a temp dir)")
    p.add_argument(
        "--engine",
        choices=("auto", "vLLM", "embedded"),
        default="auto",
        help="serving engine: vLLM where it is installed (auto, the default), or tpuray's embedded engine",
    )
    p.add_argument(
        "--rl",
        action="store_true",
        help="then a second act: GRPO on the same emulated slice (tpuray.rl; examples/rl_grpo.py), "
        "the mean reward per iteration",
    )
    p.add_argument("--rl-iterations", type=int, default=15, help="GRPO iterations with --rl (default 15)")
    p.add_argument("--quiet", action="store_true", help="print only the answer")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's and Ray's log lines here (default: in a log file under ~/.tpuray/logs, named at the "
        "start)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tpuray.console import quiet_logs
    from tpuray.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        accelerator_type=args.accelerator_type,
        topology=args.topology,
        epochs=args.epochs,
        lr=args.lr,
        question=args.question,
        workdir=args.workdir,
        quiet=args.quiet,
        verbose=args.verbose,
        engine=args.engine,
        rl=args.rl,
        rl_iterations=args.rl_iterations,
    )
    run_demo(cfg, logs=quiet_logs("demo", args.verbose))
    return 0
