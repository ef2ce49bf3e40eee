"""The emulated tpu device in a single process.

Two fresh interpreters (process startup dominates on a busy machine): one with TPURAY_EMULATION=1 runs
the device checks, one without it checks the not-available error and the explicit activate().
"""

from __future__ import annotations

import json

import pytest

from conftest import run_python

EMULATED = """
import json, io
import torch
from torch import nn
dev = torch.device("tpu")
r = {}
x = torch.ones(2, 2, device=dev) * 3
r["type"] = type(x).__name__
r["device"] = str(x.device)
r["numpy"] = x.cpu().numpy().tolist()
r["repr"] = repr(x)
r["module"] = repr(torch.tpu)
r["avail"] = [torch.tpu.is_available(), torch.tpu.device_count(), torch.tpu.current_device()]
torch.manual_seed(0); a = torch.randn(5, device="tpu"); torch.manual_seed(0)
r["randn_matches_cpu"] = torch.equal(a.cpu(), torch.randn(5))
r["arange"] = torch.arange(4, device="tpu").cpu().tolist()
r["zeros_int"] = str(torch.zeros(3, dtype=torch.int64, device="tpu:0").dtype)
c = torch.tensor([1.0, 2.0]).to("tpu")
r["to_tpu"] = [str(c.device), c.is_tpu, c.tpu() is c, str(c.to("cpu").device)]
v = x.view(4); v.add_(1)          # in-place through a view writes the base
r["view_inplace"] = x.cpu().tolist()
y = x.t(); y[0, 1] = 7.0          # setitem on a transposed view
r["setitem"] = x.cpu().tolist()
r["item"] = torch.ones(1, device="tpu").item()
s = torch.empty(3, device="tpu"); s.copy_(torch.tensor([1.0, 2.0, 3.0]))
r["copy_"] = s.cpu().tolist()
buf = io.BytesIO(); torch.save({"w": x}, buf); buf.seek(0)
loaded = torch.load(buf)["w"]
r["save_load"] = [str(loaded.device), torch.equal(loaded.cpu(), x.cpu())]
try:
    torch.add(torch.ones(3, device="tpu"), 1, out=torch.empty(0, device="tpu"))
    r["resize"] = "no error"
except RuntimeError as e:
    r["resize"] = str(e)

def train(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.to(device)   # parameters move in place: the optimizer keeps them
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
r["tolist"] = x.tolist()
r["zeros_like_cpu"] = str(torch.zeros_like(x, device="cpu").device)
try:
    x.numpy()
except TypeError as e:
    r["numpy_error"] = str(e)
r["ops"] = [
    x[x > 4.5].tolist(),
    (x > 4.5).nonzero().tolist(),
    torch.where(x > 4.5, x, -x).tolist(),
    torch.cat([x, x], 1).shape[1],
    torch.nn.functional.scaled_dot_product_attention(*[torch.ones(1, 2, 3, 4, device=dev)] * 3).device.type,
]
lin = nn.Linear(8, 8).to("tpu")
with torch.autocast("tpu", dtype=torch.bfloat16):
    h = lin(torch.randn(4, 8, device="tpu"))
    r["autocast"] = [str(h.dtype), str(torch.softmax(h, -1).dtype)]

l_cpu, p_cpu = train("cpu")
l_tpu, p_tpu = train("tpu")
r["train_losses"] = [l_cpu, l_tpu]
r["train_params_equal"] = all(torch.equal(a, b) for a, b in zip(p_cpu, p_tpu))
print(json.dumps(r))
"""

PLAIN = """
import os, torch, torch.distributed as dist
assert not hasattr(torch, "tpu"), "tpu device registered without TPURAY_EMULATION"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
try:
    dist.init_process_group(backend="tpu_dist")
except RuntimeError as e:
    print(e)
print("---")
os.environ["TPU_VISIBLE_CHIPS"] = "2,3"
import tpuray.runtime as rt
assert not hasattr(torch, "tpu")
assert rt.activate() == "emulated" and rt.activate() == "emulated" and rt.is_emulated()
assert os.environ["TPURAY_EMULATION"] == "1"
assert torch.tpu.device_count() == 2
torch.tpu.set_device(1)
assert torch.ones(1, device="tpu").device == torch.device("tpu:1")
try:
    torch.tpu.set_device(2)
except ValueError as e:
    print(e)
"""

COMPILE = """
import json, torch
from torch import nn

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("tpu")

x = torch.randn(5, 8).to("tpu")
r = {}
for backend in ("aot_eager", "inductor"):
    eager, model = make(), make()
    out = torch.compile(model, backend=backend)(x)
    ref = eager(x)
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = [torch.allclose(a.grad.cpu(), b.grad.cpu(), atol=1e-6)
             for a, b in zip(model.parameters(), eager.parameters())]
    r[backend] = [type(out).__name__, str(out.device), torch.allclose(out.cpu(), ref.cpu(), atol=1e-6),
                  all(grads), str(model[0].weight.grad.device)]
print(json.dumps(r))
"""


@pytest.fixture(scope="module")
def emulated() -> dict:
    return json.loads(run_python(EMULATED).stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain() -> list[str]:
    return run_python(PLAIN, emulation=False).stdout.split("---")


def test_factories_copies_views_and_module(emulated):
    r = emulated
    assert r["type"] == "TpuTensor" and r["device"] == "tpu:0"
    assert r["numpy"] == [[3.0, 3.0], [3.0, 3.0]]
    assert "emulated" in r["repr"] and "tpu:0" in r["repr"]
    assert "EMULATED" in r["module"]
    assert r["avail"] == [True, 1, 0]
    assert r["randn_matches_cpu"]
    assert r["arange"] == [0, 1, 2, 3] and r["zeros_int"] == "torch.int64"
    assert r["to_tpu"] == ["tpu:0", True, True, "cpu"]
    assert r["view_inplace"] == [[4.0, 4.0], [4.0, 4.0]]
    assert r["setitem"] == [[4.0, 4.0], [7.0, 4.0]]
    assert r["item"] == 1.0 and r["copy_"] == [1.0, 2.0, 3.0]
    assert r["save_load"] == ["tpu:0", True]
    assert r["tolist"] == [[4.0, 4.0], [7.0, 4.0]] and r["zeros_like_cpu"] == "cpu"
    assert "Use Tensor.cpu()" in r["numpy_error"]
    assert r["ops"] == [[7.0], [[1, 0]], [[-4.0, -4.0], [7.0, -4.0]], 4, "tpu"]
    assert r["autocast"] == ["torch.bfloat16", "torch.float32"]
    assert "resizing a tensor on the emulated tpu device in place is not supported" in r["resize"]


def test_training_matches_cpu(emulated):
    """A few AdamW steps on the emulated device give exactly the CPU's numbers."""
    l_cpu, l_tpu = emulated["train_losses"]
    assert l_cpu == l_tpu and l_tpu[0] > l_tpu[-1]
    assert emulated["train_params_equal"]


def test_without_emulation_tpu_dist_explains_itself(plain):
    msg = plain[0]
    assert "tpu_dist" in msg and "tpuray[tpu]" in msg and "tpuray emulate up" in msg
    assert "TPURAY_EMULATION=1" in msg and "TPURAY_EMULATION is unset" in msg


def test_activate_explicitly_and_visible_chips(plain):
    assert "out of range" in plain[1] and "TPU_VISIBLE_CHIPS='2,3'" in plain[1]


def test_torch_compile_on_the_emulated_device():
    """torch.compile (AOTAutograd, and inductor's CPU kernels) sees through the wrapper: same numbers,
    outputs and gradients stay on the tpu device."""
    r = json.loads(run_python(COMPILE).stdout.strip().splitlines()[-1])
    for backend in ("aot_eager", "inductor"):
        assert r[backend] == ["TpuTensor", "tpu:0", True, True, "tpu:0"], (backend, r[backend])
