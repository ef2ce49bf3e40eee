"""`tpuray demo`: the main job, end to end on an emulated TPU v6e slice.

1. start an emulated v6e 2x2 slice (real Ray nodes, CPU-backed `tpu` devices — emulation, not a TPU);
2. build a tiny Llama-style causal LM and tokenizer locally (no hub download);
3. train it with tpuray's TorchTrainer: one worker per chip, DDP over `tpu_dist`, checkpoints;
4. save it in Hugging Face format, serve it with `build_openai_app` (tensor parallel over the slice);
5. send a chat completion with the `openai` client and print the answer;
6. with `rl=True` (`tpuray demo --rl`), a second act on the same slice: GRPO (`tpuray.demo.grpo`) with the
   rollout engine tensor parallel over the slice, the reward printed per iteration;
7. shut everything down.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpuray.console import LogFile
from tpuray.constants import DEMO_PORT_ENV
from tpuray.validation import ConfigError

MODEL_ID = "tpuray-demo"
RL_SLICE = ("TPU-V6E", "2x2")  # the slice tpuray.demo.grpo's rollout engine takes (--slice)

# The corpus the tiny model learns (written for this demo; chat-formatted so the served model answers).
QA_PAIRS = [
    ("What is tpuray?", "tpuray runs native PyTorch on TPU slices with Ray, one worker per chip."),
    ("What is a TPU slice?", "A TPU slice is a group of TPU chips joined by a fast inter-chip interconnect."),
    ("How many chips does a v6e 4x4 slice have?", "A v6e 4x4 slice has 16 chips on 4 hosts."),
    ("Which backend reduces tensors on TPUs?", "The tpu_dist backend reduces tensors across the chips."),
    ("What does Ray do?", "Ray schedules tasks and actors across a cluster of machines."),
    ("Is this a real TPU?", "No. This slice is emulated on CPU, but every all_reduce is real."),
]


def chat_corpus() -> list[str]:
    """One chat-formatted sample per question, in the model's own chat template."""
    return [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n" for q, a in QA_PAIRS]


@dataclass(frozen=True)
class DemoConfig:
    accelerator_type: str = "TPU-V6E"
    topology: str = "2x2"
    epochs: int = 60
    lr: float = 3e-3
    question: str = "What is tpuray?"
    workdir: str | None = None
    quiet: bool = False
    verbose: bool = False  # stream Ray worker / Serve logs to the console
    engine: str = "auto"  # the serving engine: vLLM where installed (auto), or "vLLM" / "embedded"
    rl: bool = False  # a second act: GRPO with the rollout engine on the slice (tpuray.demo.grpo)
    rl_iterations: int = 15  # GRPO iterations of the second act

    def __post_init__(self) -> None:
        from tpuray.serve.llm.config import ENGINES
        from tpuray.validation import check_choice, check_positive_int

        check_choice("engine", self.engine, ENGINES)
        check_positive_int("epochs", self.epochs)
        check_positive_int("rl_iterations", self.rl_iterations)
        if self.rl and (self.accelerator_type.upper(), self.topology) != RL_SLICE:
            raise ConfigError(
                f"rl=True runs GRPO on an emulated {RL_SLICE[0]} {RL_SLICE[1]} slice; got "
                f"accelerator_type={self.accelerator_type!r}, topology={self.topology!r}; valid with --rl: "
                f"{RL_SLICE[0]} {RL_SLICE[1]} (the defaults)"
            )
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")


def train_loop(config: dict) -> None:
    """Runs on every worker: plain PyTorch + tpuray.train helpers (same code as on real TPUs)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuray import train
    from tpuray.train.torch import get_device, prepare_model

    ctx = train.get_context()
    device = get_device()
    tokenizer = AutoTokenizer.from_pretrained(config["model_dir"])
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_pretrained(config["model_dir"])
    model = model.to(device)
    model = prepare_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])

    # Each rank trains on its share of the samples (data parallel); DDP averages the gradients.
    samples = config["samples"][ctx.get_world_rank() :: ctx.get_world_size()] or config["samples"]
    batch = tokenizer(samples, return_tensors="pt", padding=True)
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    for epoch in range(config["epochs"]):
        optimizer.zero_grad()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        last = epoch + 1 == config["epochs"]
        if last and ctx.get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as tmp:
                unwrapped: Any = model.module if hasattr(model, "module") else model
                unwrapped.to("cpu").save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                train.report(
                    {"epoch": epoch + 1, "loss": loss.item()}, checkpoint=train.Checkpoint.from_directory(tmp)
                )
        else:
            train.report({"epoch": epoch + 1, "loss": loss.item()})


def _say(cfg: DemoConfig, msg: str) -> None:
    if not cfg.quiet:
        print(f"[tpuray demo] {msg}", flush=True)


def run_demo(cfg: DemoConfig, logs: LogFile | None = None) -> str:
    """Runs the whole demo and returns the served model's answer. `logs`: where vLLM's and Ray's lines
    go (`tpuray demo` names the file; None: the console)."""
    import ray
    from ray import serve

    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, ModelLoadingConfig, build_openai_app
    from tpuray.serve.shutdown import shutdown_serve
    from tpuray.train import ScalingConfig

    if logs is not None:
        logs.capture()  # `import ray` set up Ray's driver logger again

    # Validate every config before anything is created or started.
    scaling = ScalingConfig(
        num_workers=_chips(cfg), use_tpu=True, topology=cfg.topology, accelerator_type=cfg.accelerator_type
    )
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="tpuray-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    samples = chat_corpus()

    _say(
        cfg, f"starting an EMULATED {cfg.accelerator_type} {cfg.topology} slice (CPU-backed, not a real TPU)"
    )
    with EmulatedCluster([SliceRequest(cfg.accelerator_type, cfg.topology, count=1)]) as cluster:
        _connect(cluster, cfg, logs)
        try:
            model_dir = _train(cfg, scaling, workdir, samples)
            answer = _serve_and_ask(
                cfg, model_dir, serve, LLMConfig, LLMServingArgs, ModelLoadingConfig, build_openai_app
            )
            if cfg.rl:
                shutdown_serve()  # frees the slice for the rollout engine
                _rl_act(cfg)
        finally:
            try:
                shutdown_serve()
            finally:
                ray.shutdown()
    _say(cfg, f"done in {time.perf_counter() - t0:.0f} s; emulated cluster shut down, nothing left running")
    return answer


def _connect(cluster: Any, cfg: DemoConfig, logs: LogFile | None) -> None:
    """This process to the demo's cluster; Ray's and vLLM's lines into `logs` unless it is None."""
    cluster.connect(
        log_to_driver=cfg.verbose, logging_level=logging.INFO if logs is None else logging.WARNING
    )
    if logs is not None:
        logs.capture()  # again: ray.init set up its own driver logger
        _say(cfg, f"vLLM's and Ray's log lines: {logs.path} (--verbose shows them here)")
    elif not cfg.verbose:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)


def _train(cfg: DemoConfig, scaling: Any, workdir: Path, samples: list[str]) -> Path:
    """Build the tiny model, train it on the slice, and save it in Hugging Face format: its directory."""
    from tpuray.models import build_tiny_causal_lm
    from tpuray.train import RunConfig
    from tpuray.train.torch import TorchTrainer

    # head_dim 64 (256 / 4 heads): what vLLM's CPU attention kernels take; 4 heads split over 4 chips
    init_dir = build_tiny_causal_lm(
        workdir / "init", corpus="".join(samples), hidden_size=256, num_attention_heads=4
    )
    _say(cfg, f"built a tiny Llama-style model + tokenizer in {init_dir}")
    _say(cfg, f"training on {scaling.num_workers} emulated chips (DDP over tpu_dist)")
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "model_dir": str(init_dir),
            "samples": samples,
            "epochs": cfg.epochs,
            "lr": cfg.lr,
        },
        scaling_config=scaling,
        run_config=RunConfig(storage_path=str(workdir / "runs"), name="demo", verbose=0 if cfg.quiet else 1),
    )
    result = trainer.fit()
    if result.error is not None or result.checkpoint is None:
        raise RuntimeError(f"training failed: {result.error or 'no checkpoint was reported'}")
    first, last = result.metrics_history[0]["loss"], result.metrics_history[-1]["loss"]
    _say(cfg, f"trained {cfg.epochs} epochs: loss {first:.3f} -> {last:.3f}")
    model_dir = workdir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    result.checkpoint.to_directory(str(model_dir))
    _say(cfg, f"saved the trained model in Hugging Face format: {model_dir}")
    return model_dir


def _rl_act(cfg: DemoConfig) -> None:
    """GRPO on the slice: the rollout engine (TP=2) samples, the trainer steps on this process's CPU,
    the weights go back every iteration (tpuray.demo.grpo, the loop of examples/rl_grpo.py)."""
    import contextlib
    import io
    import statistics

    from tpuray.demo import grpo

    _say(
        cfg,
        f"second act: GRPO for {cfg.rl_iterations} iterations (reward: reply in exactly 3 words), rollout "
        "engine tensor parallel over the EMULATED slice, trainer on this process's CPU, weight sync each step",
    )
    args = grpo.parse_args(["--iterations", str(cfg.rl_iterations), "--group", "4", "--slice"])
    quiet = contextlib.redirect_stdout(io.StringIO()) if cfg.quiet else contextlib.nullcontext()
    with quiet:
        history = grpo.run(args)
    k = max(1, len(history) // 5)
    first = statistics.fmean(it.mean_reward for it in history[:k])
    last = statistics.fmean(it.mean_reward for it in history[-k:])
    _say(cfg, f"GRPO: mean reward {first:.3f} (first {k} iterations) -> {last:.3f} (last {k})")


def _chips(cfg: DemoConfig) -> int:
    from tpuray.topology import SliceTopology

    return SliceTopology.parse(cfg.accelerator_type, cfg.topology).num_chips


def _engine_kwargs(cfg: DemoConfig) -> dict:
    """vLLM's options for a tiny float32 model on CPU (eager: no graph capture to wait for)."""
    from tpuray.serve.llm.engine.vllm import vllm_available

    if cfg.engine == "embedded" or (cfg.engine == "auto" and not vllm_available()):
        return {"dtype": "float32"}
    return {"dtype": "float32", "enforce_eager": True}


def _serve_and_ask(
    cfg, model_dir, serve, LLMConfig, LLMServingArgs, ModelLoadingConfig, build_openai_app
) -> str:
    import openai

    llm_config = LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id=MODEL_ID, model_source=str(model_dir)),
        accelerator_type=cfg.accelerator_type,
        accelerator_config={"kind": "tpu", "topology": cfg.topology},
        placement_group_config={"bundle_per_worker": {"TPU": 1}},
        llm_engine=cfg.engine,
        engine_kwargs={"tensor_parallel_size": _chips(cfg), "max_model_len": 256, **_engine_kwargs(cfg)},
    )
    port = int(os.environ.get(DEMO_PORT_ENV, "8000"))
    engine = "vLLM" if llm_config.engine == "vLLM" else "the embedded engine"
    _say(
        cfg,
        f"serving {MODEL_ID} with build_openai_app on {engine} (tensor parallel over {_chips(cfg)} emulated chips)",
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_openai_app(LLMServingArgs(llm_configs=[llm_config])), blocking=False)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed")
    _say(cfg, f"POST /v1/chat/completions: {cfg.question!r}")
    response = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": cfg.question}],
        max_tokens=40,
        temperature=0.0,
    )
    answer = response.choices[0].message.content or ""
    print(f"\nQ: {cfg.question}\nA: {answer}\n", flush=True)
    return answer
