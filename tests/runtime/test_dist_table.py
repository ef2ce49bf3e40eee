"""The emulated tpu_dist against TorchTPU's, call by call (tests/real_tpu/dist_table.py: the table the
chip's test runs too): inside a TorchTrainer on an emulated v6e 2x2 (four ranks), and in one process at
world size 1, as on the chip. Each call works on both or fails on both with the same words."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray.cloudpickle

from conftest import run_python
from real_tpu import dist_table
from tpuray.train import RunConfig, ScalingConfig
from tpuray.train.torch import TorchTrainer

for _module in (dist_table, sys.modules[__name__]):  # the workers cannot import tests/ by name
    ray.cloudpickle.register_pickle_by_value(_module)


def _table_loop(config: dict) -> None:
    import tpuray.train.torch as tt
    from tpuray import train

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    outcomes = dist_table.run(tt.get_device(), rank, world)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(outcomes))


def test_the_table_inside_a_torch_trainer_on_a_2x2(emulated_cluster, pg_leak_check, tmp_path) -> None:
    TorchTrainer(
        _table_loop,
        train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E"),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="table", verbose=0),
    ).fit()
    for rank in range(4):
        outcomes = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert dist_table.mismatches(outcomes, world=4) == {}, f"rank {rank}"
        assert outcomes["all_gather_object"] is None and outcomes["batch_isend_irecv"] is None


def test_the_table_in_one_process_as_on_the_chip(tmp_path) -> None:
    store = tmp_path / "store"
    proc = run_python(
        f"""
        import json, torch.distributed as dist
        from tpuray.runtime import activate
        from real_tpu import dist_table
        activate()
        dist.init_process_group("tpu_dist", init_method="file://{store}", rank=0, world_size=1)
        print(json.dumps(dist_table.run(__import__("torch").device("tpu"), 0, 1)))
        """,
        extra_env={"PYTHONPATH": str(Path(__file__).parents[1])},
    )
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dist_table.mismatches(outcomes, world=1) == {}
    assert set(outcomes) == set(dist_table.expected(1)) and "isend/irecv" not in outcomes
