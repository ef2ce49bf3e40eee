"""tpuray.rl.RolloutEngine over real vLLM (its CPU build) with vLLM's engine core and its one worker in the
caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, a one-chip TPU VM's setting): `update_weights` hands
the state dict's tensors to the worker as they are (`tpuray_stage_tensors`), and the worker, holding the
whole model, sends them to its device a window ahead of vLLM's reload (`tpuray.rl.weights.prefetch`).

In a child process of its own (with a timeout): an in-process engine holds torch.distributed and vLLM's
globals until it stops (tests/serve/backends/test_engine_proof.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"
)

CHILD = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from transformers import AutoModelForCausalLM
from tpuray.rl import RolloutConfig, WeightMismatchError, rollout_engine
from tpuray.serve.llm.generation import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello world", "1 + 2 =", "The"]

def started(path):
    return rollout_engine(RolloutConfig(path, engine="vllm", max_model_len=64, max_num_seqs=4, dtype="float32"))

def greedy(engine):
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]

def main(a, b):
    with started(b) as engine:
        want_b = greedy(engine)
    state_a = AutoModelForCausalLM.from_pretrained(a).state_dict()
    state_b = AutoModelForCausalLM.from_pretrained(b).state_dict()
    with started(a) as engine:
        assert engine._engine.vllm.in_process and engine.tensor_parallel_size == 1
        tokens_a = greedy(engine)
        assert tokens_a != want_b, tokens_a
        stats = engine.update_weights(state_b)
        assert stats.version == 1 and stats.bytes_written > 0, stats
        assert greedy(engine) == want_b  # as if started from b's checkpoint
        bad = dict(state_a, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 128)})
        try:  # past the driver's check: the worker refuses it before anything is loaded
            engine._loop.run(engine._load("tpuray_stage_tensors", (bad,)))
            raise AssertionError("the worker accepted a misshapen update")
        except WeightMismatchError as e:
            assert "'model.layers.0.mlp.up_proj.weight' has shape (3, 128)" in str(e), e
        assert greedy(engine) == want_b  # b's weights kept
        engine.update_weights(state_a)
        assert greedy(engine) == tokens_a  # a's output again
    print("VLLM-IN-PROCESS-OK", flush=True)
    sys.stdout.flush()
    os._exit(0)

if __name__ == "__main__":
    main(*sys.argv[1:3])
"""


def test_update_weights_in_process_loads_what_a_start_from_the_checkpoint_loads(vllm_models, tmp_path):
    """The in-process engine started from a, updated to b's state dict, gives the greedy tokens of an
    engine started from b; a misshapen update reaching the worker is refused there and changes nothing;
    updating back to a gives a's tokens again."""
    script = tmp_path / "vllm_in_process_child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    out = subprocess.run(
        [sys.executable, str(script), *vllm_models], capture_output=True, text=True, timeout=300, env=env
    )
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0 and "VLLM-IN-PROCESS-OK" in out.stdout, tail
