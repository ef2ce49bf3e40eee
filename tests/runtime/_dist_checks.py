"""Multi-process checks of tpu_dist on the emulated device; run by tests/runtime/test_dist.py.

    TPURAY_EMULATION=1 python tests/runtime/_dist_checks.py collectives,training WORLD PORT

Each rank asserts its own results; any failure makes torch.multiprocessing.spawn (and so the process)
exit non-zero with the rank's traceback. Prints "<check> OK" per rank.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

R = dist.ReduceOp


def _eq(t: torch.Tensor, expected, what: str) -> None:
    assert t.device.type == "tpu", f"{what}: result left the tpu device ({t.device})"
    got = t.cpu()
    exp = torch.as_tensor(expected, dtype=got.dtype).expand_as(got)
    assert torch.equal(got, exp), f"{what}: got {got.tolist()}, expected {exp.tolist()}"


def collectives(rank: int, world: int) -> None:
    dev = torch.device("tpu")
    assert dist.get_backend() == "tpu_dist"
    ranks = torch.arange(world, dtype=torch.float32) + 1  # rank r contributes r + 1
    for op, expected in (
        (R.SUM, ranks.sum()),
        (R.PRODUCT, ranks.prod()),
        (R.MIN, ranks.min()),
        (R.MAX, ranks.max()),
        (R.AVG, ranks.mean()),
    ):
        t = torch.full((2, 3), float(rank + 1), device=dev)
        view = t[1]  # a view must see the in-place result too
        dist.all_reduce(t, op=op)
        _eq(t, expected, f"all_reduce {op}")
        _eq(view, expected, f"all_reduce {op} (view)")
    ints = torch.full((3,), rank + 1, dtype=torch.int64, device=dev)
    dist.all_reduce(ints)
    _eq(ints, int(ranks.sum()), "all_reduce int64")

    work = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
    work.wait()
    value = work.get_future().value()[0]
    _eq(value, world, "async all_reduce future value")

    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=world - 1)
    _eq(b, world - 1, "broadcast")

    outs = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank), device=dev))
    for r, o in enumerate(outs):
        _eq(o, r, "all_gather")
    flat = torch.empty(2 * world, device=dev)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device=dev))
    _eq(flat, torch.arange(world).repeat_interleave(2), "all_gather_into_tensor")

    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=dev))
    _eq(out, torch.arange(2.0 * world)[2 * rank : 2 * rank + 2] * world, "reduce_scatter_tensor")
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.ones(2 * world, device=dev), op=R.AVG, async_op=True).wait()
    _eq(out, 1.0, "reduce_scatter_tensor AVG async")
    out = torch.empty(2, device=dev)
    dist.reduce_scatter(out, [torch.full((2,), float(i + rank), device=dev) for i in range(world)], op=R.AVG)
    _eq(out, rank + (world - 1) / 2, "reduce_scatter AVG")

    out = torch.empty(world, device=dev)
    dist.all_to_all_single(out, torch.arange(world, device=dev, dtype=torch.float32) + 10 * rank)
    _eq(out, torch.arange(world) * 10 + rank, "all_to_all_single")
    outs = [torch.empty(1, device=dev) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((1,), 10.0 * rank + i, device=dev) for i in range(world)])
    for r, o in enumerate(outs):
        _eq(o, 10 * r + rank, "all_to_all")

    # host tensors are refused with TorchTPU's words (tests/real_tpu/test_dist_table.py)
    for refused in (lambda: dist.all_reduce(torch.ones(2)), lambda: dist.broadcast(torch.ones(2), src=0)):
        try:
            refused()
        except RuntimeError as e:
            assert "No backend type associated with device type cpu" in str(e), f"host tensor refused: {e}"
        else:
            raise AssertionError("tpu_dist took a host tensor; TorchTPU's refuses it")

    dist.barrier()
    if rank == 0:
        dist.send(torch.arange(3.0, device=dev), dst=1)
    elif rank == 1:
        got = torch.empty(3, device=dev)
        dist.recv(got, src=0)
        _eq(got, torch.arange(3.0), "send/recv")


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(dtype)


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * 8, 6, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _reference_grads(world: int) -> list[torch.Tensor]:
    """Gradients of the full-batch loss in float64 on CPU: what every rank must end up with."""
    x, y = _data(world)
    ref = _model(torch.float64)
    torch.nn.functional.mse_loss(ref(x.double()), y.double()).backward()
    return [p.grad for p in ref.parameters()]


def _check_grads(grads, world: int, what: str) -> None:
    for got, ref in zip(grads, _reference_grads(world), strict=True):
        assert got.device.type == "cpu"
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    # identical across ranks, bit for bit
    for got in grads:
        gathered = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(gathered, got, group=_GLOO)
        assert all(torch.equal(g, got) for g in gathered), f"{what}: gradients differ across ranks"


_GLOO = None


def training(rank: int, world: int) -> None:
    global _GLOO
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    _GLOO = dist.new_group(backend="gloo")  # to compare CPU copies of the results across ranks
    dev = torch.device("tpu")
    x, y = _data(world)
    x, y = x[rank * 8 : (rank + 1) * 8].to(dev), y[rank * 8 : (rank + 1) * 8].to(dev)

    for bucket_view, compiled in ((False, False), (True, False), (False, True)):
        model = _model(torch.float32).to(dev)
        # eager: tiny buckets, so several all_reduces per step; compiled: Dynamo's DDPOptimizer wants
        # DDP's default bucket sizes
        buckets = {} if compiled else {"bucket_cap_mb": 0.0005}
        ddp = DDP(model, gradient_as_bucket_view=bucket_view, **buckets)
        step = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        torch.nn.functional.mse_loss(step(x), y).backward()
        assert all(p.grad.device.type == "tpu" for p in model.parameters())
        what = f"DDP bucket_view={bucket_view} compiled={compiled}"
        _check_grads([p.grad.cpu() for p in model.parameters()], world, what)
        torch.optim.SGD(ddp.parameters(), lr=0.1).step()

    mesh = init_device_mesh("tpu", (world,))
    d = distribute_tensor(torch.arange(4.0 * world, device=dev), mesh, [Shard(0)])
    _eq(d.to_local(), torch.arange(4.0 * world)[4 * rank : 4 * rank + 4], "DTensor shard")
    _eq(d.redistribute(mesh, [Replicate()]).to_local(), torch.arange(4.0 * world), "DTensor redistribute")

    model = _model(torch.float32).to(dev)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    torch.nn.functional.mse_loss(model(x), y).backward()
    _check_grads([p.grad.full_tensor().cpu() for p in model.parameters()], world, "FSDP2")
    opt.step()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()  # a second step re-gathers the updated shards
    opt.step()


def _three_steps(model: torch.nn.Module, world: int) -> None:
    x, y = _data(world)
    for _ in range(3):  # DDP samples runtime stats from its second iteration on
        torch.nn.functional.mse_loss(model(x[:8].to("tpu")), y[:8].to("tpu")).backward()


def plain_ddp(rank: int, world: int) -> None:
    """DDP built directly on the tpu device, as a user's script or Ray Train's prepare_model does: c10d's
    time-stats sampling is off for it (tpuray.runtime.ddp), the rest of its logger works."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(torch.float32).to("tpu"))
    _three_steps(model, world)
    assert model._get_ddp_logging_data()["backend_name"] == "tpu_dist"


def c10d_time_stats(rank: int, world: int) -> None:
    """The control: c10d's own logger under the tpuray wrapper, sampled after three steps, prints the
    time-stats warning (so its absence elsewhere means the wrapper silenced it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tpuray.runtime.ddp import NoRuntimeStatsLogger

    model = DDP(_model(torch.float32).to("tpu"))
    _three_steps(model, world)
    assert isinstance(model.logger, NoRuntimeStatsLogger)
    model.logger.wrapped.set_runtime_stats_and_log()


def prepare_model(rank: int, world: int) -> None:
    """tpuray.train.torch.prepare_model in a training session: DDP over tpu_dist on the tpu device."""
    from tpuray.train import session
    from tpuray.train.torch import get_device, prepare_model

    ctx = session.TrainContext(rank, world, rank, world, 0, "check", "/tmp", "/tmp", device_type="tpu")
    session.start_session(ctx, None, 0)
    model = prepare_model(_model(torch.float32))
    assert type(model).__name__ == "DistributedDataParallel" and get_device().type == "tpu"
    _three_steps(model, world)
    assert model._get_ddp_logging_data()["backend_name"] == "tpu_dist"  # the rest of DDP's logger works


CHECKS = {
    "collectives": collectives,
    "training": training,
    "plain_ddp": plain_ddp,
    "prepare_model": prepare_model,
    "c10d_time_stats": c10d_time_stats,
}


def _run(rank: int, checks: list[str], world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend="tpu_dist")
    group = dist.group.WORLD
    try:
        for check in checks:
            CHECKS[check](rank, world)
            print(f"{check} OK rank {rank}", flush=True)
    finally:
        dist.destroy_process_group()
    # destroy_process_group shut gloo down and dropped it here: left to the interpreter's exit, with a
    # DDP model still holding the group, gloo's threads aborted about one exit in five
    try:
        group.barrier()
    except RuntimeError as e:
        assert "shut down" in str(e), e
    else:
        raise AssertionError("a shut-down tpu_dist group still ran a barrier")


if __name__ == "__main__":
    checks, world, port = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(_run, args=(checks, world, port), nprocs=world)
