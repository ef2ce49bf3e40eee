"""``torch.autocast("tpu")`` for the emulated device.

PyTorch ships autocast kernels for its in-tree devices only; a PrivateUse1 backend registers its own.
Every op falls through the AutocastPrivateUse1 key except two short lists, mirroring the CUDA/CPU
policy: matmul-like ops run in the autocast dtype (bfloat16 by default), numerically sensitive
reductions and losses run in float32.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]

LOWER_PRECISION = (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv",
    "conv1d", "conv2d", "conv3d", "conv1d.padding", "conv2d.padding", "conv3d.padding",
    "convolution", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "scaled_dot_product_attention", "prelu",
)  # fmt: skip
FLOAT32 = (
    "softmax.int", "log_softmax.int", "layer_norm", "group_norm", "rms_norm", "logsumexp",
    "cumsum", "cumprod", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss",
    "cross_entropy_loss", "binary_cross_entropy_with_logits", "kl_div", "exp", "log", "log1p",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "rsqrt", "reciprocal", "norm.Scalar", "cosine_similarity",
)  # fmt: skip

_LIBS: list[torch.library.Library] = []


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _kernel(op, lower: bool):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("tpu") if lower else torch.float32
        args = _cast(args, dtype)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    return kernel


def register_autocast() -> None:
    """Register the AutocastPrivateUse1 fallthrough and casting kernels (once per process)."""
    if _LIBS:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    for names, lower in ((LOWER_PRECISION, True), (FLOAT32, False)):
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet), overload or "default")
            lib.impl(name, _kernel(op, lower), _KEY)
    _LIBS.extend([fallthrough, lib])
