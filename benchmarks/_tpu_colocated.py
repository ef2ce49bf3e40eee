"""Colocated vLLM on one chip: the hand-over a colocated RL run makes between rollouts and training, with
vLLM inside the trainer's process (`tpuray.rl.rollout.vllm_colocated.HostedVLLM`: `vllm.LLM` as rank 0 of
a one-rank process group, vLLM's external launcher), measured as `weights` measures the embedded engine's.

Each round: sleep (vLLM's own sleep mode where the platform has one; else tpuray frees the KV cache, the
weights staying on the device), the full bf16 state dict's host tensors staged (handed to vLLM's worker in
this process, as a rank has them from the object store) and committed while asleep, each timed; wake-up;
then 32 greedy tokens of one prompt, which must equal those before the first round (the same weights were
sent). The device's live bytes (torch's allocator) are
read around each step on a TPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINE_ARGS = {"max_model_len": 1024, "max_num_seqs": 32, "dtype": "bfloat16", "seed": 0}
PROMPT = list(range(11, 43))


def start_hosted(path: Path) -> Any:
    """HostedVLLM in this process, rank 0 of a one-rank group (torch's fake backend where no TCP opens)."""
    import torch.distributed as dist

    from tpuray.rl.rollout.vllm_colocated import HostedVLLM
    from tpuray.serve.llm.engine.vllm.inprocess import one_rank_groups_without_tcp

    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))  # names vLLM's CPU groups
    store = dist.FileStore(tempfile.mktemp(prefix="tpuray-colocated-"), 1)
    with one_rank_groups_without_tcp():
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return HostedVLLM(str(path), dict(ENGINE_ARGS))


def greedy(hosted: Any) -> list[int]:
    from tpuray.serve.llm.generation import SamplingParams

    (out,) = hosted.generate([PROMPT], [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)])
    return out[0]


def update_split(hosted: Any, state: dict) -> dict:
    """One update while asleep, each step timed: staged (the host tensors handed to vLLM's worker extension
    in this process and checked), committed (vLLM's reload, each tensor sent to the device ahead of it)."""
    row: dict[str, Any] = {}
    t = time.perf_counter()
    staged = hosted.stage_weights(state)
    row["stage_s"], t = time.perf_counter() - t, time.perf_counter()
    row["staged"] = staged if isinstance(staged, int) else f"refused: {staged}"
    row["written"] = hosted.commit_weights()
    row["commit_s"] = time.perf_counter() - t
    return row


def handover_rounds(hosted: Any, state: dict, rounds: int, device: str) -> list[dict]:
    """`rounds` hand-overs of `state` (the engine's own weights), each timed step by step."""
    from _tpu_engine import live_bytes

    live = live_bytes(device)
    before = greedy(hosted)
    rows = []
    for _ in range(rounds):
        row: dict[str, Any] = {"live_bytes_awake": live()}
        t = time.perf_counter()
        row["freed_bytes"] = hosted.sleep(level=1)
        row["sleep_s"], t = time.perf_counter() - t, time.perf_counter()
        row["live_bytes_asleep"] = live()
        row |= update_split(hosted, state)
        row["update_s"], t = time.perf_counter() - t, time.perf_counter()
        row["retaken_bytes"] = hosted.wake_up()
        row["wake_up_s"] = time.perf_counter() - t
        row["handover_s"] = row["sleep_s"] + row["update_s"] + row["wake_up_s"]
        row["same_tokens"] = greedy(hosted) == before
        rows.append(row)
    return rows


def vllm_handover(path: Path, state: dict, rounds: int, device: str, report: Any) -> None:
    """Start colocated vLLM on the checkpoint (reported at once), then `rounds` hand-overs."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    hosted = start_hosted(path)
    report("vllm_colocated_start", start_s=time.perf_counter() - t0, own_sleep=hosted.own_sleep)
    try:
        for i, row in enumerate(handover_rounds(hosted, state, rounds, device)):
            report("vllm_colocated_handover", round=i, **row)
    finally:
        hosted.unload()
        dist.destroy_process_group()
