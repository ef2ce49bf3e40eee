"""Ray Train's OWN TorchTrainer (`ray.train`, not tpuray.train) on emulated slices: the announcement's sample
verbatim (examples/ray_train_seed.py) through Ray 2.60's `use_tpu=True` path, with tpuray's emulated
torch_tpu on the emulated hosts' import path."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import pytest
import ray
import ray.cloudpickle

from tpuray.emulator import SliceRequest

sys.path.insert(0, os.path.dirname(__file__))
from _examples import load_example  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _quick_controller_polls() -> Iterator[None]:
    """Ray Train's controller polls its workers every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), so a fit
    ends up to 2 s after its workers do, at each state change; it passes the variable on to its actors.
    Polled more often here: what these tests check does not depend on the period."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
        yield


def _example():
    return load_example("ray_train_seed.py")


def _probe_loop(config: dict) -> None:
    """The seed's loop, then each rank writes what it ran on (through Ray Train's own helpers)."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch_tpu

    config["seed_fn"](config)
    t = torch.ones(2, device=ray.train.torch.get_device()) * dist.get_rank()
    dist.all_reduce(t)
    ctx = ray.train.get_context()
    keys = ("RANK", "LOCAL_RANK", "TPU_VISIBLE_CHIPS", "TPU_WORKER_ID", "TPURAY_EMULATION")
    doc = {k: os.environ.get(k) for k in keys}
    doc.update(
        rank=ctx.get_world_rank(),
        device=str(t.device),
        backend=dist.get_backend(),
        all_reduce=t.cpu().tolist(),
        torch_tpu_emulated=getattr(torch_tpu, "EMULATED", False),
        node_id=ray.get_runtime_context().get_node_id(),
    )
    with open(os.path.join(config["out_dir"], f"rank{ctx.get_world_rank()}.json"), "w") as f:
        json.dump(doc, f)


def _fit(example, scaling, tmp_path) -> list[dict]:
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        _probe_loop,
        train_loop_config={"out_dir": str(tmp_path), "seed_fn": example.train_fn_per_worker},
        scaling_config=scaling,
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="ray-train"),
    )
    result = trainer.fit()
    assert result.error is None
    return sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda d: d["rank"])


def test_emulated_torch_tpu_is_on_emulated_hosts_only(emulated_cluster) -> None:
    @ray.remote(num_cpus=0)
    def probe() -> dict:
        from tpuray.runtime import detect

        out = {"installed_counts_as_real": detect.torch_tpu_installed()}
        try:
            import torch_tpu

            out["imported"] = bool(torch_tpu.EMULATED)
        except ImportError as e:
            out["imported"] = str(e)
        return out

    on_host = ray.get(probe.options(resources={"TPU": 1}).remote(), timeout=300)
    assert on_host == {"installed_counts_as_real": False, "imported": True}
    head = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        next(n["NodeID"] for n in ray.nodes() if n["Alive"] and not n["Resources"].get("TPU")), soft=False
    )
    off_host = ray.get(probe.options(scheduling_strategy=head).remote(), timeout=300)
    assert (
        off_host["installed_counts_as_real"] is False
        and "No module named 'torch_tpu'" in off_host["imported"]
    )


def test_ray_train_seed_on_an_emulated_2x2(emulated_cluster, pg_leak_check, tmp_path) -> None:
    """The seed's loop verbatim through Ray Train's own TorchTrainer(use_tpu=True) on one of the default
    layout's v6e 2x2 slices: 4 ranks on the emulated `tpu` device with tpu_dist, one chip each of one host."""
    from ray.train import ScalingConfig

    scaling = ScalingConfig(
        num_workers=4,
        use_tpu=True,
        topology="2x2",
        accelerator_type="TPU-V6E",
        resources_per_worker={"TPU": 1},
    )
    ranks = _fit(_example(), scaling, tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["device"].startswith("tpu") and r["backend"] == "tpu_dist" and r["torch_tpu_emulated"]
        assert r["all_reduce"] == [6.0, 6.0] and r["TPURAY_EMULATION"] == "1" and r["TPU_WORKER_ID"] == "0"
    assert len({r["node_id"] for r in ranks}) == 1
    assert sorted(r["TPU_VISIBLE_CHIPS"] for r in ranks) == ["0", "1", "2", "3"]


@pytest.mark.full(
    "CI: the same sample through Ray Train on a 2x2 (test_ray_train_seed_on_an_emulated_2x2), a 4x4 "
    "slice's four hosts (slices/test_layouts.py)"
)
@pytest.mark.slow
def test_ray_train_seed_verbatim_on_emulated_4x4(cluster_manager, pg_leak_check, tmp_path) -> None:
    """The seed's 4x4 sample through Ray Train: every rank on the emulated `tpu` device with tpu_dist, its
    own chip of its own host (one 16-worker fit checks what a 2x2 fit would, and the four hosts)."""
    cluster_manager.get(SliceRequest("TPU-V6E", "4x4"), head_cpus=2)
    example = _example()
    assert example.scaling_config.num_workers == 16
    ranks = _fit(example, example.scaling_config, tmp_path)
    assert [r["rank"] for r in ranks] == list(range(16))
    for r in ranks:
        assert r["device"].startswith("tpu") and r["backend"] == "tpu_dist" and r["torch_tpu_emulated"]
        assert r["all_reduce"] == [120.0, 120.0] and r["TPURAY_EMULATION"] == "1"
    for host in {r["node_id"] for r in ranks}:
        assert sorted(r["TPU_VISIBLE_CHIPS"] for r in ranks if r["node_id"] == host) == ["0", "1", "2", "3"]
    assert len({r["node_id"] for r in ranks}) == 4  # the slice's four emulated hosts
    assert sorted(r["TPU_WORKER_ID"] for r in ranks) == sorted(str(h) for h in range(4) for _ in range(4))
