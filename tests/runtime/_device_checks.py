"""Single-process checks of the emulated tpu device; run by tests/runtime/test_device.py in a fresh
interpreter (registering the device renames PyTorch's PrivateUse1 key for the process's whole life).

    TPURAY_EMULATION=1 python tests/runtime/_device_checks.py emulated   # the device checks
    python tests/runtime/_device_checks.py plain                         # no emulation: errors, activate()
    TPURAY_EMULATION=1 python tests/runtime/_device_checks.py compile    # torch.compile on the device

Each prints one JSON line of observations (the last line of stdout); the tests assert on it.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any

import torch
from torch import nn


def _train(device: str) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.to(device)  # parameters move in place: the optimizer keeps them
    x = torch.randn(64, 10, device=device)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.device.type == torch.device(device).type for p in model.parameters())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    return losses, [p.detach().cpu() for p in model.parameters()]


def emulated() -> dict[str, Any]:
    dev = torch.device("tpu")
    r: dict[str, Any] = {}
    x = torch.ones(2, 2, device=dev) * 3
    r["type"] = type(x).__name__
    r["device"] = str(x.device)
    r["numpy"] = x.cpu().numpy().tolist()
    r["repr"] = repr(x)
    r["module"] = repr(torch.tpu)
    r["avail"] = [torch.tpu.is_available(), torch.tpu.device_count(), torch.tpu.current_device()]
    torch.manual_seed(0)
    a = torch.randn(5, device="tpu")
    torch.manual_seed(0)
    r["randn_matches_cpu"] = torch.equal(a.cpu(), torch.randn(5))
    r["arange"] = torch.arange(4, device="tpu").cpu().tolist()
    r["zeros_int"] = str(torch.zeros(3, dtype=torch.int64, device="tpu:0").dtype)
    c = torch.tensor([1.0, 2.0]).to("tpu")
    r["to_tpu"] = [str(c.device), c.is_tpu, c.tpu() is c, str(c.to("cpu").device)]
    v = x.view(4)
    v.add_(1)  # in-place through a view writes the base
    r["view_inplace"] = x.cpu().tolist()
    y = x.t()
    y[0, 1] = 7.0  # setitem on a transposed view
    r["setitem"] = x.cpu().tolist()
    r["item"] = torch.ones(1, device="tpu").item()
    s = torch.empty(3, device="tpu")
    s.copy_(torch.tensor([1.0, 2.0, 3.0]))
    r["copy_"] = s.cpu().tolist()
    buf = io.BytesIO()
    torch.save({"w": x}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["w"]
    r["save_load"] = [str(loaded.device), torch.equal(loaded.cpu(), x.cpu())]
    try:
        torch.add(torch.ones(3, device="tpu"), 1, out=torch.empty(0, device="tpu"))
        r["resize"] = "no error"
    except RuntimeError as e:
        r["resize"] = str(e)
    r["tolist"] = x.tolist()
    r["zeros_like_cpu"] = str(torch.zeros_like(x, device="cpu").device)
    try:
        x.numpy()
        r["numpy_error"] = "no error"
    except TypeError as e:
        r["numpy_error"] = str(e)
    r["ops"] = [
        x[x > 4.5].tolist(),
        (x > 4.5).nonzero().tolist(),
        torch.where(x > 4.5, x, -x).tolist(),
        torch.cat([x, x], 1).shape[1],
        nn.functional.scaled_dot_product_attention(*[torch.ones(1, 2, 3, 4, device=dev)] * 3).device.type,
    ]
    lin = nn.Linear(8, 8).to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        h = lin(torch.randn(4, 8, device="tpu"))
        r["autocast"] = [str(h.dtype), str(torch.softmax(h, -1).dtype)]
    l_cpu, p_cpu = _train("cpu")
    l_tpu, p_tpu = _train("tpu")
    r["train_losses"] = [l_cpu, l_tpu]
    r["train_params_equal"] = all(torch.equal(a, b) for a, b in zip(p_cpu, p_tpu, strict=True))
    return r


def plain() -> dict[str, Any]:
    import torch.distributed as dist

    r: dict[str, Any] = {"tpu_before": hasattr(torch, "tpu")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    try:
        dist.init_process_group(backend="tpu_dist")
        r["init_error"] = "no error"
    except RuntimeError as e:
        r["init_error"] = str(e)
    os.environ["TPU_VISIBLE_CHIPS"] = "2,3"
    import tpuray.runtime as rt

    r["tpu_after_import"] = hasattr(torch, "tpu")
    r["activate"] = [rt.activate(), rt.activate(), rt.is_emulated(), os.environ.get("TPURAY_EMULATION")]
    r["device_count"] = torch.tpu.device_count()
    torch.tpu.set_device(1)
    r["set_device_1"] = str(torch.ones(1, device="tpu").device)
    try:
        torch.tpu.set_device(2)
        r["set_device_2"] = "no error"
    except ValueError as e:
        r["set_device_2"] = str(e)
    return r


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("tpu")


def compile_() -> dict[str, Any]:
    x = torch.randn(5, 8).to("tpu")
    r: dict[str, Any] = {}
    for backend in ("aot_eager", "inductor"):
        eager, model = _make_model(), _make_model()
        out = torch.compile(model, backend=backend)(x)
        ref = eager(x)
        out.square().sum().backward()
        ref.square().sum().backward()
        grads = [
            torch.allclose(a.grad.cpu(), b.grad.cpu(), atol=1e-6)
            for a, b in zip(model.parameters(), eager.parameters(), strict=True)
        ]
        r[backend] = [
            type(out).__name__,
            str(out.device),
            torch.allclose(out.cpu(), ref.cpu(), atol=1e-6),
            all(grads),
            str(model[0].weight.grad.device),
        ]
    return r


CHECKS = {"emulated": emulated, "plain": plain, "compile": compile_}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]]()))
