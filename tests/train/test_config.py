"""ScalingConfig / RunConfig validation: bad input fails at construction, naming the value and what is valid."""

from __future__ import annotations

import pytest

from tpuray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

V6E = dict(use_tpu=True, accelerator_type="TPU-V6E")


def test_seed_scaling_config_is_valid() -> None:
    sc = ScalingConfig(num_workers=16, topology="4x4", resources_per_worker={"TPU": 1}, **V6E)
    assert sc.num_slices == 1 and sc.workers_per_host == 4 and sc.backend == "tpu_dist"
    assert sc.slice_topology.num_hosts == 4
    assert sc.worker_resources() == {"TPU": 1, "CPU": 0}


def test_num_slices_inferred_like_ray() -> None:
    assert ScalingConfig(num_workers=8, topology="2x2", **V6E).num_slices == 2
    two_chip = ScalingConfig(num_workers=2, topology="2x2", resources_per_worker={"TPU": 2}, **V6E)
    assert two_chip.workers_per_host == 2


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (dict(num_workers=0), ["num_workers=0", ">= 1"]),
        (dict(num_workers=4, use_tpu=True, use_gpu=True), ["use_tpu=True, use_gpu=True"]),
        (dict(num_workers=4, use_tpu=True), ["topology", "accelerator_type", "4x4"]),
        (dict(num_workers=4, use_tpu=True, topology="2x2"), ["accelerator_type=None"]),
        (
            dict(num_workers=4, topology="2x2", accelerator_type="TPU-V9Z", use_tpu=True),
            ["TPU-V9Z", "TPU-V6E"],
        ),
        (dict(num_workers=4, topology="3x3", **V6E), ["3x3", "2x2", "4x4"]),
        (dict(num_workers=6, topology="2x2", **V6E), ["num_workers=6", "4"]),
        (
            dict(num_workers=4, topology="2x2", resources_per_worker={"TPU": 3}, **V6E),
            ["TPU']=3", "valid: 1, 2, 4."],
        ),
        (
            dict(num_workers=1, topology="2x2", resources_per_worker={"TPU": 8}, **V6E),
            ["TPU']=8", "valid: 1, 2, 4."],
        ),
        (dict(num_workers=4, topology="2x2", num_slices=2, **V6E), ["num_workers=4", "num_workers=8"]),
        (dict(num_workers=2, resources_per_worker={"TPU": 1}), ["requests TPU", "use_tpu=True"]),
        (dict(num_workers=2, topology="2x2"), ["topology='2x2'", "use_tpu=True"]),
        (dict(num_workers=2, resources_per_worker={"CPU": -1}), ["CPU", "-1"]),
        (dict(num_workers=2, placement_strategy="TIGHT"), ["TIGHT", "PACK"]),
    ],
)
def test_bad_scaling_config(kwargs: dict, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        ScalingConfig(**kwargs)
    for needle in needles:
        assert needle in str(err.value)


def test_run_config_defaults_and_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TPURAY_QUIET", raising=False)
    rc = RunConfig(storage_path=str(tmp_path), name="run")
    assert rc.storage_path == str(tmp_path) and rc.failure_config.max_failures == 0 and not rc.quiet
    assert RunConfig(storage_path="file:///x").storage_path == "file:///x"
    assert RunConfig().name.startswith("TorchTrainer_")
    assert RunConfig(verbose=0).quiet
    monkeypatch.setenv("TPURAY_QUIET", "1")
    assert RunConfig().quiet
    with pytest.raises(ValueError, match="memory://"):
        RunConfig(storage_path="memory://bucket")
    with pytest.raises(ValueError, match="name='a/b'"):
        RunConfig(name="a/b")
    with pytest.raises(ValueError, match="max_failures=-2"):
        FailureConfig(max_failures=-2)
    with pytest.raises(ValueError, match="num_to_keep=0"):
        CheckpointConfig(num_to_keep=0)


def test_import_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, tpuray.train; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_trainer_rejects_bad_arguments_before_reserving() -> None:
    from tpuray.train.torch import TorchTrainer

    def loop(config):
        pass

    with pytest.raises(TypeError, match="tpuray.train.ScalingConfig"):
        TorchTrainer(loop, scaling_config={"num_workers": 2})
    with pytest.raises(ValueError, match=r"datasets\['train'\]=\[1, 2\] is invalid: use a ray.data.Dataset"):
        TorchTrainer(loop, datasets={"train": [1, 2]})
    with pytest.raises(TypeError, match="train_loop_config=3"):
        TorchTrainer(loop, train_loop_config=3)
    with pytest.raises(TypeError, match="must be callable"):
        TorchTrainer("not a function")


def test_run_state_commits_and_rewinds_exactly_once() -> None:
    """Report i is committed once every rank made it; a restart resumes after the newest committed
    checkpoint and forgets rank-0 history past it."""
    from tpuray.train.checkpoint.manager import RunState
    from tpuray.train.session import ReportRecord

    state, seen = RunState(world_size=2), []
    rec = lambda i, ck, rank0=True: ReportRecord(i, {"epoch": i + 1} if rank0 else None, ck)  # noqa: E731
    state.add(0, [rec(0, True), rec(1, False), rec(2, True)], seen.append)
    state.add(1, [rec(0, True, False), rec(1, False, False)], seen.append)
    assert state.commit() == 0  # rank 1 has not made report 2 yet
    assert len(seen) == 3
    assert state.rewind() == 1  # restart after checkpoint 0
    assert [m["epoch"] for m in state.metrics_history()] == [1]
    state.add(0, [rec(1, False), rec(2, True)], seen.append)
    state.add(1, [rec(1, False, False), rec(2, True, False)], seen.append)
    assert state.commit() == 2
    assert [m["epoch"] for m in state.metrics_history()] == [1, 2, 3]


@pytest.mark.parametrize("auto_transfer", [True, False])
def test_prepare_data_loader_moves_every_batch_in_order(auto_transfer: bool) -> None:
    """Outside a run (world size 1) the loader is not resharded; batches come in order on the device,
    moved one ahead on a background thread (auto_transfer) or when asked for."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tpuray.train.torch import prepare_data_loader

    data = TensorDataset(torch.arange(10.0))
    loader = prepare_data_loader(DataLoader(data, batch_size=3), auto_transfer=auto_transfer)
    got = [batch for (batch,) in loader]
    assert torch.equal(torch.cat(got), torch.arange(10.0)) and len(loader) == 4
    assert {b.device.type for b in got} == {"cpu"}
    assert [batch for (batch,) in loader][0].tolist() == [0.0, 1.0, 2.0]  # iterable again
