"""The embedded rollout engine's weight updates and sleep / wake-up on the real chip (`tpuray.rl.rollout.embedded_worker`'s
`RunnerWeights` over an in-process `ModelRunner`, as `RolloutEngine` runs a one-chip engine; no Ray).

Two small models trained here with different seeds, a and b (same shapes, confident greedy choices): the
chip's engine starts with a's weights, takes b's (a full state dict, and the pieces a trainer rank cuts
from tensors on the chip, as a colocated run sends them) and must then give the CPU engine's greedy
tokens for b, with no program rebuilt; a misshapen update is refused and changes nothing; asleep, the
weights and the KV cache leave the chip (the device allocator's count falls by the bytes `sleep` reports)
and an update made meanwhile is on the chip after `wake_up`; at sleep level 2 the weights are discarded
instead of copied to the host, and the update taken asleep is what wakes up; handed over in process
(`tpuray.rl.sync.handover`), the trainer's shards cut on the chip become the weights at wake-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpuray.serve.llm.engine.embedded.runner import ModelRunner

KW = dict(max_num_seqs=4, max_model_len=256, dtype="float32")
PROMPT = list(range(5, 17))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tpuray.models import train_tiny_causal_lm

    root = tmp_path_factory.mktemp("rollout")
    return [
        str(train_tiny_causal_lm(root / name, steps=150, seed=seed)) for name, seed in (("a", 0), ("b", 1))
    ]


def _greedy(runner: ModelRunner, n: int = 32, slot: int = 0) -> list[int]:
    out, res = [], runner.step([(slot, PROMPT, 0, None)], need_logits=False)
    for i in range(n - 1):
        assert res is not None
        out.append(res.token_ids[0])
        res = runner.step([(slot, [out[-1]], len(PROMPT) + i, None)], need_logits=False)
    assert res is not None
    return [*out, res.token_ids[0]]


def _device_bytes() -> int:
    """Bytes the chip's allocator holds for live tensors (torch.accelerator's count, which torch_tpu's
    allocator keeps)."""
    torch.accelerator.synchronize()
    return int(torch.accelerator.memory_allocated())


def test_updates_and_sleep_on_the_chip(tpu, models, highest_precision):
    from tpuray.rl.rollout.embedded_worker import RunnerWeights
    from tpuray.rl.weights.check import WeightMismatchError
    from tpuray.rl.weights.cut import trainer_pieces
    from tpuray.rl.weights.join import assemble
    from tpuray.serve.llm.engine.embedded.model import load_state_dict

    a, b = models
    want_a, want_b = _greedy(ModelRunner(a, **KW)), _greedy(ModelRunner(b, **KW))
    assert want_a != want_b
    chip = ModelRunner(a, device="tpu", **KW)
    built = chip.warmup()
    weights = RunnerWeights(chip, a, rank=0, world_size=1)
    assert _greedy(chip) == want_a

    state_b = load_state_dict(b)
    assert weights.stage(state_b) > 0 and weights.commit() > 0  # a full state dict, from the host
    assert _greedy(chip) == want_b

    bad = dict(state_b, **{"lm_head.weight": state_b["lm_head.weight"][:-1]})
    with pytest.raises(WeightMismatchError, match="lm_head.weight"):
        weights.stage(bad)
    assert weights.staged is None and _greedy(chip) == want_b  # refused: nothing written

    before = _device_bytes()
    freed = weights.sleep()
    after = _device_bytes()
    print(f"device bytes: awake {before}, asleep {after}; sleep reports {freed} freed")
    assert freed > 0 and before - after >= freed
    # asleep, the trainer's weights (a's, on the chip) arrive as a colocated run sends them: pieces cut
    # on the chip, joined and fused on the host, held there until wake-up
    on_chip = {n: t.to(tpu) for n, t in load_state_dict(a).items()}
    config = json.loads((Path(a) / "config.json").read_text())
    pieces = trainer_pieces(on_chip, 0, 1)
    assert weights.stage_shards(assemble(pieces, config, 0, 1)) > 0 and weights.commit() > 0
    del on_chip
    assert weights.wake_up() == freed and _device_bytes() >= before
    assert _greedy(chip) == want_a
    # level 2: the weights are discarded (no copy to the host); b's update, taken asleep, is what wakes
    awake = _device_bytes()
    assert weights.sleep(2) == freed and awake - _device_bytes() >= freed
    with pytest.raises(RuntimeError, match="needs a weight update first"):
        weights.wake_up()
    assert weights.stage(state_b) > 0 and weights.commit() > 0 and weights.wake_up() == freed
    assert _greedy(chip) == want_b
    _hand_over_on_the_chip(weights, tpu, a, freed)
    assert _greedy(chip) == want_a
    assert chip.compilations == built  # updates, sleep and the hand-over rebuilt no program


def _hand_over_on_the_chip(weights, tpu, path: str, freed: int) -> None:
    """A colocated hand-over over weight_sync="tpu_dist" (`tpuray.rl.sync.handover`): the trainer's weights
    (`path`'s) on the chip are cut and fused there by the trainer rank and left in the process; the
    engine, asleep at level 2, takes those shards and wakes up with them as its weights (no copy): the
    shards stay on the chip, and wake-up allocates only the KV cache."""
    from tpuray.rl.sync import handover
    from tpuray.serve.llm.engine.embedded.model import load_state_dict

    on_chip = {n: t.to(tpu) for n, t in load_state_dict(path).items()}
    assert weights.sleep(2) == freed
    shards = handover.rank_shards(on_chip, 0, 1, weights.config)
    assert {t.device.type for t in shards.values()} == {"tpu"}
    handover.keep("update", shards)
    assert weights.stage_pieces([handover.Handed("update")]) > 0 and weights.commit() > 0
    held = _device_bytes()
    shard_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in shards.values()}.values())
    del shards
    assert weights.wake_up() == freed
    woke = _device_bytes()
    print(f"hand-over: shards {shard_bytes} bytes; wake-up allocated {woke - held} of the {freed} freed")
    assert woke - held < freed - shard_bytes // 2  # the weights were adopted, not allocated again
