"""Training on a real TPU chip for bench_real_tpu.py (`train`): the chip's bf16 matmul ceiling, the seed's
loop and a GPT train step, each through tpuray's helpers (get_device, prepare_model) and raw torch_tpu.
Each function reports its figures through `report` (the script's)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from _tpu_engine import timed

V5E_BF16_FLOPS = 197e12
Report = Callable[..., None]


def bench_matmul(device: torch.device, report: Report) -> None:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    compiled = torch.compile(lambda x, y: x @ y, backend="tpu" if device.type == "tpu" else "inductor")
    for label, fn in (("eager", lambda: a @ b), ("compiled", lambda: compiled(a, b))):
        s = timed(fn, 10)
        flops = 2 * n**3 / s
        report(f"matmul_bf16_{label}", tflops=flops / 1e12, fraction_of_peak=flops / V5E_BF16_FLOPS)


class GPT(torch.nn.Module):
    """nanoGPT-shaped decoder (pre-norm, GELU MLP, causal SDPA)."""

    def __init__(self, d: int, layers: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, idx):
        h = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def bench_gpt(device: torch.device, via_tpuray: bool, compiled: bool, steps: int, report: Report) -> None:
    d, layers, heads, vocab, seq, batch = 1024, 8, 16, 32000, 512, 8
    torch.manual_seed(0)
    model = GPT(d, layers, heads, vocab, seq).to(torch.bfloat16)
    if via_tpuray:
        from tpuray.train.torch import get_device, prepare_model

        device = get_device()
        model = prepare_model(model)
    else:
        model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, vocab, (batch, seq), device=device)

    forward = (
        torch.compile(model, backend="tpu" if device.type == "tpu" else "inductor") if compiled else model
    )

    def train_step():  # forward + backward compiled (AOTAutograd); the optimizer step stays eager
        logits = forward(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab).float(), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    s = timed(train_step, steps)  # its first, untimed call compiles
    flops = 6 * params * batch * seq / s
    report(
        "gpt_train_step",
        via="tpuray" if via_tpuray else "raw",
        compiled=compiled,
        params=params,
        ms=s * 1e3,
        model_tflops=flops / 1e12,
        fraction_of_peak=flops / V5E_BF16_FLOPS,
    )


def bench_seed_loop(device: torch.device, via_tpuray: bool, steps: int, report: Report) -> None:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    if via_tpuray:
        from tpuray.train.torch import get_device, prepare_model

        device, model = get_device(), prepare_model(model)
    else:
        model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 10, device=device), torch.randn(32, 1, device=device)

    def step():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    report("seed_loop_step", via="tpuray" if via_tpuray else "raw", ms=timed(step, steps) * 1e3)


def bench_train(args, report: Report) -> None:
    device = torch.device(args.device)
    parts = args.parts.split(",")
    if "matmul" in parts:
        bench_matmul(device, report)
    if "seed" in parts:
        for via in (False, True, False, True):  # alternated: the ratio is within one run
            bench_seed_loop(device, via, 200, report)
    for compiled in [c for c in (False, True) if ("gpt-compiled" if c else "gpt-eager") in parts]:
        for via in (False, True):
            bench_gpt(device, via, compiled, args.steps, report)
