"""examples/rl_grpo.py (tpuray.demo.grpo): GRPO with the rollout engine in this process (the mean reward
rises) and on an emulated slice (the loop runs with TP=2 and weight sync every iteration; with the trainer on
tpuray.train on the other slice, overlapped)."""

from __future__ import annotations

import runpy
import statistics
from pathlib import Path

import pytest

from tpuray.demo import grpo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_grpo.py"


def _example() -> dict:
    """The example's names (its `main` guarded: nothing runs)."""
    return runpy.run_path(str(EXAMPLE))


def test_the_example_runs_the_package_loop():
    assert _example()["grpo"] is grpo


def test_reward_and_advantages():
    assert [grpo.reward(t, 3) for t in ("a b c", "a b", "", "a b c d e f g")] == pytest.approx(
        [1.0, 2 / 3, 0.0, 0.0]
    )
    adv = grpo.group_advantages([1.0, 0.0, 0.5, 0.5], group=2)
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0
    with pytest.raises(SystemExit):
        grpo.parse_args(["--group", "0"])
    with pytest.raises(SystemExit):
        grpo.parse_args(["--overlap"])  # needs --trainer tpuray
    with pytest.raises(SystemExit):
        grpo.parse_args(["--trainer", "tpuray", "--overlap", "--colocate"])  # colocated phases take turns
    example_args = _example()["parse_args"]  # the loop's options and the example's (the cluster it starts)
    for starts_no_slice in (
        ["--cores", "per_slice"],
        ["--slice", "--address", "x:1", "--cores", "per_slice"],
    ):
        with pytest.raises(SystemExit):
            example_args(starts_no_slice)
    assert example_args(["--trainer", "tpuray", "--overlap", "--cores", "per_slice"]).cores == "per_slice"


def test_grpo_in_process_raises_the_mean_reward(capsys, tmp_path):
    history = grpo.run(grpo.parse_args(["--iterations", "30"]))
    means = [it.mean_reward for it in history]
    assert len(means) == 30 and all(0.0 <= m <= 1.0 for m in means)
    assert statistics.fmean(means[-8:]) > statistics.fmean(means[:8]) + 0.05, means
    out = capsys.readouterr().out
    assert "iter  29  mean_reward" in out and "logp_gap" in out
    png = tmp_path / "reward.png"
    _example()["plot"](means, str(png))
    assert png.stat().st_size > 0


@pytest.mark.full(
    "CI: the example's loop in process (test_grpo_in_process_raises_the_mean_reward), RLRun on slices (rl/sync/test_sync.py, rl/test_placement.py)"
)
def test_grpo_on_an_emulated_slice(emulated_cluster, pg_leak_check, capsys):
    history = grpo.run(grpo.parse_args(["--iterations", "3", "--group", "4", "--slice", "--colocate"]))
    assert len(history) == 3 and all(it.sync_bytes > 0 and it.generate_s > 0 for it in history)
    out = capsys.readouterr().out
    assert "tensor_parallel_size=2" in out and "EMULATED TPU" in out
    # the trainer on tpuray.train (FSDP2, one slice), the engine on the other, overlapped (RLRun)
    args = ["--iterations", "2", "--group", "2", "--trainer", "tpuray", "--overlap"]
    history = grpo.run(grpo.parse_args(args))
    assert len(history) == 2 and all(it.train_s > 0 and it.sync_bytes > 0 for it in history)
    pg_leak_check()
