"""A vLLM rollout engine from Python: generate, load a second model's weights, generate again.

    python examples/rl_vllm_rollout.py            # vLLM on this machine's CPU (vLLM's CPU build)
    python examples/rl_vllm_rollout.py --slice    # TP=4 over an emulated v6e 2x2 slice, one vLLM worker per chip

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
    from tpuray.rl import RolloutConfig, RolloutEngine, WeightMismatchError
    from tpuray.rl.vllm_rollout import SleepModeUnavailable
    from tpuray.serve.llm.engine.embedded.sampling import SamplingParams

    shape = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 256}
    first, second = (str(build_tiny_causal_lm(workdir / n, seed=s, **shape)) for n, s in (("a", 0), ("b", 1)))
    where = {"accelerator_type": "TPU-V6E", "topology": "2x2"} if on_slice else {}
    config = RolloutConfig(first, engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32", **where)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with RolloutEngine(config) as engine:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice", action="store_true", help="TP=4 on an emulated v6e 2x2 slice")
    args = parser.parse_args(argv)
    cluster = None
    if args.slice:
        from tpuray.emulator import EmulatedCluster, SliceRequest

        cluster = EmulatedCluster([SliceRequest("TPU-V6E", "2x2")], head_cpus=2)
        cluster.start()
        cluster.connect()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(Path(tmp), args.slice)
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard is needed
    main()
