"""A vLLM rollout engine from Python: generate, load a second model's weights, generate again.

    python examples/rl_vllm_rollout.py            # vLLM on this machine's CPU (vLLM's CPU build)
    python examples/rl_vllm_rollout.py --slice    # TP=4 over an emulated v6e 2x2 slice, one vLLM worker per chip
    python examples/rl_vllm_rollout.py --rlrun    # an RLRun: tpuray.train (FSDP2) on one slice, vLLM on another

Two tiny models of the same shapes (different seeds) are built locally by
`tpuray.models.build_tiny_causal_lm` (head_dim 32: vLLM's CPU attention needs >= 32). The engine loads the
first; `update_weights` sends the second's state dict (checked, then loaded in place by every vLLM
worker), so the greedy tokens change. A misshapen update is refused with the old weights kept, and
`sleep()` on vLLM's CPU backend says why it cannot. See docs/rl.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

PROMPTS = ["Hello world", "1 + 2 =", "The"]


def run(workdir: Path, on_slice: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tpuray.models import build_tiny_causal_lm
    from tpuray.rl import RolloutConfig, WeightMismatchError, rollout_engine
    from tpuray.rl.rollout.vllm import SleepModeUnavailable
    from tpuray.serve.llm.generation import SamplingParams

    shape = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 256}
    first, second = (str(build_tiny_causal_lm(workdir / n, seed=s, **shape)) for n, s in (("a", 0), ("b", 1)))
    where = {"accelerator_type": "TPU-V6E", "topology": "2x2"} if on_slice else {}
    config = RolloutConfig(first, engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32", **where)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with rollout_engine(config) as engine:
        print("engine:", engine.describe()["where"])
        print("first model: ", [r.text for r in engine.generate(PROMPTS, greedy)])
        state = AutoModelForCausalLM.from_pretrained(second).state_dict()
        stats = engine.update_weights(state)
        print(
            f"update_weights: {stats.bytes_written} bytes in {stats.seconds:.2f} s (version {stats.version})"
        )
        print("second model:", [r.text for r in engine.generate(PROMPTS, greedy)])
        try:
            engine.update_weights({**state, "model.norm.weight": torch.ones(3)})
        except WeightMismatchError as e:
            print("refused:", e)
        try:
            engine.sleep()
        except SleepModeUnavailable as e:
            print("sleep:", e)


def fsdp2_sender(config: dict) -> list:
    """The RLRun's trainer (2 ranks, FSDP2): each iteration sends the second model as the next version,
    each rank only its Shard(0) rows, cut per vLLM rank (tpuray.rl.weights.vllm_layout)."""
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
    sent = []
    for k in range(rl.iterations):
        rl.batch(k)
        sent.append(rl.send(model, version=k + 1))
    return sent


def run_rl(workdir: Path) -> None:
    """RLRun with vLLM rollouts (TP=4, one worker per chip, kv_heads 1: each rank holds a copy of the one
    KV head) and the default weight_sync="tpu_dist": each vLLM worker joins a process group with the
    trainer's ranks and receives only the pieces of its own part ("object_store": it pulls them)."""
    from transformers import AutoModelForCausalLM

    from tpuray.demo.grpo import two_slices
    from tpuray.models import build_tiny_causal_lm
    from tpuray.rl import RLConfig, RLRun, RolloutConfig
    from tpuray.serve.llm.generation import SamplingParams
    from tpuray.train import RunConfig

    shape = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
    }
    first, second = (str(build_tiny_causal_lm(workdir / n, seed=s, **shape)) for n, s in (("a", 0), ("b", 1)))
    rollout = RolloutConfig(
        first, engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32",
        accelerator_type="TPU-V6E", topology="2x2",
    )  # fmt: skip
    trainer = two_slices(first, 4)[1]  # 2 workers x 2 chips on a v6e 2x2 slice (the GRPO example's)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    full_load: dict[str, list] = {}

    def rollout_fn(engine, k: int) -> list:
        tokens = [r.token_ids for r in engine.generate(PROMPTS, greedy)]
        print(f"batch {k}: {tokens}")
        if k == 1:  # the same weights loaded whole: the same tokens
            engine.update_weights(AutoModelForCausalLM.from_pretrained(second).state_dict())
            full_load["tokens"] = [r.token_ids for r in engine.generate(PROMPTS, greedy)]
        return tokens

    rl = RLRun(
        RLConfig(rollout, trainer),  # weight_sync="tpu_dist"
        fsdp2_sender,
        train_loop_config={"path": second},
        run_config=RunConfig(storage_path=f"file://{workdir}/runs", name="vllm-rlrun"),
    )
    result = rl.run(2, rollout_fn)
    print("versions loaded:", result.versions, "bytes per sync:", [t.sync_bytes for t in result.times])
    same = result.batches[1] == full_load["tokens"]
    print(
        "per-rank pieces give the full load's tokens:",
        same,
        "| batch 0 != batch 1:",
        result.batches[0] != result.batches[1],
    )
    if not same:
        raise SystemExit("per-rank update differs from the full load")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice", action="store_true", help="TP=4 on an emulated v6e 2x2 slice")
    parser.add_argument(
        "--rlrun",
        action="store_true",
        help="an RLRun: FSDP2 trainer on one v6e 2x2 slice, vLLM (TP=4) on another",
    )
    args = parser.parse_args(argv)
    cluster = None
    if args.slice or args.rlrun:
        from tpuray.emulator import EmulatedCluster, SliceRequest

        count = 2 if args.rlrun else 1
        cluster = EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=count)], head_cpus=2)
        cluster.start()
        cluster.connect()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_rl(Path(tmp)) if args.rlrun else run(Path(tmp), args.slice)
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard is needed
    main()
