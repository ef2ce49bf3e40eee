"""tpuray's runtime layer on a real TPU chip: activation, the emulator's refusal, tensors and the
announcement's loop against the CPU, tpu_dist (world size 1), DDP, FSDP2/DTensor, get_device/prepare_model."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_activate_is_real_and_the_emulator_refuses(tpu):
    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.runtime import activate, is_emulated
    from tpuray.validation import ConfigError

    assert activate() == "real" and not is_emulated()
    with pytest.raises(ConfigError, match="usable TPU chips"):
        EmulatedCluster([SliceRequest("TPU-V6E", "2x2")]).start()


def test_tensors_agree_with_cpu(tpu, highest_precision):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    got = (a.to(tpu) @ b.to(tpu)).relu().sum(0).cpu()
    torch.testing.assert_close(got, (a @ b).relu().sum(0), atol=1e-3, rtol=1e-4)
    x = torch.ones(2, 2, device=tpu) * 3
    assert x.device.type == "tpu" and x.cpu().tolist() == [[3.0, 3.0], [3.0, 3.0]]


def _announcement_loop(device: torch.device) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 10, generator=g), torch.randn(32, 1, generator=g)) for _ in range(10)]
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach().cpu()))
    return losses


def test_announcement_loop_agrees_with_cpu(tpu, highest_precision):
    torch.testing.assert_close(
        _announcement_loop(tpu), _announcement_loop(torch.device("cpu")), rtol=1e-4, atol=1e-5
    )


def test_tpu_dist_collectives(tpu, process_group):
    dist = process_group
    assert dist.get_backend() == "tpu_dist" and dist.get_world_size() == 1
    t = torch.arange(4.0, device=tpu)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    out = [torch.empty(4, device=tpu)]
    dist.all_gather(out, t)
    assert t.cpu().tolist() == out[0].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_tpu_dist_takes_only_tensors_on_the_chip(tpu, process_group):
    """TorchTPU's tpu_dist refuses host tensors (found 2026-12-06 on this chip): its backend, made by its
    registered creator as a process group of one's own would be, and the default group's front end. The
    emulated tpu_dist mirrors both (tests/runtime/test_dist.py), and the RL weight sync, which moves host
    buffers, runs its group on gloo (`tpuray.rl.sync.collective.SyncGroup`)."""
    from datetime import timedelta

    dist = process_group
    create = dist.Backend._plugins["TPU_DIST"].creator_fn
    backend = create(dist.PrefixStore("probe", dist.HashStore()), 0, 1, timedelta(seconds=30))
    for call in (backend.allreduce, backend.broadcast):
        with pytest.raises(RuntimeError, match="expected tensor to be on tpu, got cpu"):
            call([torch.ones(4)]).wait()
    backend.allreduce([torch.ones(4, device=tpu)]).wait()  # the same backend takes a tensor on the chip
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(4))


def test_ddp_and_fsdp2_on_a_one_device_mesh(tpu, process_group, highest_precision):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def step(model):
        x = torch.randn(8, 10, generator=torch.Generator().manual_seed(2))
        loss = model(x.to(next(model.parameters()).device)).square().mean()
        loss.backward()
        return float(loss.detach().cpu()), next(model.parameters()).grad

    def net(device):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)

    ref_loss, ref_grad = step(net("cpu"))
    ddp_loss, ddp_grad = step(DistributedDataParallel(net(tpu)))
    mesh = init_device_mesh("tpu", (1,))
    fsdp = fully_shard(net(tpu), mesh=mesh)
    fsdp_loss, fsdp_grad = step(fsdp)
    assert ddp_loss == pytest.approx(ref_loss, rel=1e-4) and fsdp_loss == pytest.approx(ref_loss, rel=1e-4)
    torch.testing.assert_close(ddp_grad.cpu(), ref_grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fsdp_grad.full_tensor().cpu(), ref_grad, rtol=1e-4, atol=1e-5)


def test_get_device_and_prepare_model(tpu, process_group):
    from torch.nn.parallel import DistributedDataParallel

    from tpuray.train.torch import get_device, prepare_model

    assert get_device() == torch.device("tpu")  # outside a training session: the chip of this process
    model = prepare_model(nn.Linear(4, 2))
    assert next(model.parameters()).device.type == "tpu"
    assert not isinstance(model, DistributedDataParallel)  # world size 1: no wrapper, as ray.train does
