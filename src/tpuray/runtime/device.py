"""Emulated ``tpu`` device: PyTorch's PrivateUse1 key renamed to "tpu", backed by CPU memory.

A tensor on the emulated device is a :class:`TpuTensor`, a wrapper subclass (``_make_wrapper_subclass``
with ``device="tpu:N"``) around an ordinary CPU tensor. ``__torch_dispatch__`` runs every ATen op on the
wrapped CPU tensors and wraps the results again:

* in-place and ``out=`` ops return the very argument objects they mutated (autograd's version counters
  and DDP's bucket views rely on that);
* view ops return a new wrapper around the CPU view, which shares storage with the base, so writes
  through either are visible in both (autograd records the view relation on the wrappers);
* ``_to_copy`` to another device returns a plain tensor on that device (``.cpu()``, ``.to("cpu")``).

Factory functions (``torch.empty/ones/zeros/randn/arange(..., device="tpu")``) have no tensor argument
to dispatch on, so they are registered for the PrivateUse1 key with ``torch.library``: each runs the
CPU factory and wraps the result. Random numbers therefore come from the CPU generator, which
``torch.manual_seed`` seeds: ``torch.randn(3, device="tpu")`` equals ``torch.randn(3)`` under the same seed.

``torch.compile`` works through the traceable-wrapper-subclass protocol (``__tensor_flatten__``): Dynamo
and AOTAutograd see through the wrapper, and inductor compiles CPU kernels for the data inside it.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch.utils._pytree import tree_map

DEVICE_TYPE = "tpu"
# set while a collective op runs on tensors this module unwrapped: the emulated tpu_dist then takes their
# CPU tensors; a host tensor the caller passed itself is refused there, as TorchTPU refuses it
UNWRAPPED_COLLECTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("tpu_unwrapped", default=False)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})
aten = torch.ops.aten

_CPU = torch.device("cpu")


def _target_device(device: Any) -> torch.device:
    """The tpu device a factory/copy targets, with the current device index filled in."""
    dev = torch.device(device)
    if dev.index is None:
        from tpuray.runtime import device_module

        dev = torch.device(DEVICE_TYPE, device_module.current_device())
    return dev


class TpuTensor(torch.Tensor):
    """A tensor on the emulated ``tpu`` device: a wrapper around a CPU tensor (``_local``)."""

    _local: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor, device: torch.device, requires_grad: bool = False):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            local.size(),
            strides=local.stride(),
            storage_offset=local.storage_offset(),
            dtype=local.dtype,
            layout=local.layout,
            device=device,
            requires_grad=requires_grad,
        )
        r._local = local
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        body = repr(self._local.detach())
        if body.endswith(")"):
            body = body[:-1]
        extra = f", grad_fn=<{type(self.grad_fn).__name__}>" if self.grad_fn is not None else ""
        if self.requires_grad and self.grad_fn is None:
            extra = ", requires_grad=True"
        return f"{body}, device='{self.device}' (emulated on CPU){extra})"

    __str__ = __repr__

    def tolist(self):
        return self._local.tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return self._local.detach().numpy()
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    # `t.data = other` swaps the TensorImpl's metadata in C++, which knows nothing of `_local`.
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, new)  # type: ignore[attr-defined]
        self._local = local_tensor(new)

    # Storage-level access (FSDP2 frees/re-allocates unsharded parameters by resizing storages,
    # and compares data pointers) goes to the CPU storage that holds the data. While torch.compile
    # traces, the wrapper reports its own (data-less) storage instead: Dynamo fakes the wrapper and the
    # CPU tensor inside it separately, and one storage shared by both would alias a "tpu" fake with a
    # "meta" one.
    def untyped_storage(self) -> torch.UntypedStorage:
        if torch.compiler.is_compiling():
            return torch.Tensor.untyped_storage(self)
        return self._local.untyped_storage()

    def data_ptr(self) -> int:
        return self._local.data_ptr()

    def __reduce_ex__(self, proto):
        # Saved like any storage-less device tensor: the CPU data plus the device to restore it to
        # (torch.load(weights_only=True) allows this, and map_location works as usual).
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self._local.detach(), self.dtype, str(self.device), self.requires_grad),
        )

    # Traceable wrapper subclass protocol: lets nn.Module.to() swap parameters in place and lets
    # DTensor / torch.compile flatten the wrapper to its CPU tensor.
    def __tensor_flatten__(self):
        return ["_local"], self.device

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return TpuTensor(inner_tensors["_local"], ctx)

    def _stable_hash_for_caching(self) -> str:
        """torch.compile's AOTAutograd cache key: the metadata a compiled graph depends on, not the data."""
        import hashlib

        meta = (tuple(self.shape), self.stride(), str(self.dtype), str(self.device), self.requires_grad)
        return hashlib.sha256(repr(meta).encode()).hexdigest()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _SPECIAL.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        token = UNWRAPPED_COLLECTIVE.set(True) if func.namespace in _COLLECTIVE_NAMESPACES else None
        try:
            out = func(*_unwrap_args(args), **_unwrap_kwargs(kwargs))
        finally:
            if token is not None:
                UNWRAPPED_COLLECTIVE.reset(token)
        target = kwargs.get("device")
        if target is not None and torch.device(target).type != DEVICE_TYPE:
            return out  # e.g. zeros_like(t, device="cpu")
        return _wrap_result(func, args, kwargs, out, _first_device(args, kwargs))


def wrap(local: torch.Tensor, device: torch.device | str | int | None = None) -> TpuTensor:
    """Put a CPU tensor on the emulated device without copying (it becomes the device storage)."""
    return TpuTensor(local, _target_device(DEVICE_TYPE if device is None else device))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding an emulated tpu tensor's data (the tensor itself when already on CPU)."""
    return t._local if type(t) is TpuTensor else t


# ------------------------------------------------------------------------------- dispatch helpers


def _first_device(args, kwargs) -> torch.device:
    for a in args:
        if type(a) is TpuTensor:
            return a.device
        if isinstance(a, (list, tuple)):
            for b in a:
                if type(b) is TpuTensor:
                    return b.device
    for a in kwargs.values():
        if type(a) is TpuTensor:
            return a.device
    return _target_device(DEVICE_TYPE)


def _unwrap(x):
    if type(x) is TpuTensor:
        return x._local
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return _CPU
    return x


def _unwrap_args(args):
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.append(type(a)(_unwrap(b) for b in a))
        else:
            out.append(_unwrap(a))
    return out


def _unwrap_kwargs(kwargs):
    if not kwargs:
        return kwargs
    return {
        k: (tree_map(_unwrap, v) if isinstance(v, (list, tuple)) else _unwrap(v)) for k, v in kwargs.items()
    }


def _mutated_arg_index(func) -> dict[str, Any]:
    """Map alias-set name -> argument name for arguments an op writes to (cached per overload)."""
    cached = _MUTATED.get(func)
    if cached is None:
        cached = {}
        for a in func._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                for s in a.alias_info.before_set:
                    cached[s] = a
        _MUTATED[func] = cached
    return cached


_MUTATED: dict[Any, dict[str, Any]] = {}


def _arg_value(func, args, kwargs, arg):
    names = [a.name for a in func._schema.arguments]
    i = names.index(arg.name)
    if arg.kwarg_only or i >= len(args):
        return kwargs.get(arg.name)
    return args[i]


def _wrap_result(func, args, kwargs, out, device):
    mutated = _MUTATED.get(func)
    if mutated is None:
        mutated = _mutated_arg_index(func)
    if not mutated:
        return _wrap_tree(out, device)
    schema = func._schema
    if not schema.returns:
        for arg in mutated.values():
            _check_not_resized(func, _arg_value(func, args, kwargs, arg))
        return out
    # In-place / out= ops: return the argument objects that were written to.
    rets = out if isinstance(out, tuple) else (out,)
    new = []
    for r, ret in zip(rets, schema.returns, strict=False):
        info = ret.alias_info
        if info is not None and info.is_write and info.before_set:
            target = _arg_value(func, args, kwargs, mutated[next(iter(info.before_set))])
            _check_not_resized(func, target)
            new.append(target)
        else:
            new.append(_wrap_tree(r, device))
    return tuple(new) if isinstance(out, tuple) else new[0]


def _check_not_resized(func, target) -> None:
    for t in target if isinstance(target, (list, tuple)) else (target,):
        if type(t) is TpuTensor and t._local.shape != t.shape:
            raise RuntimeError(
                f"{func}: resizing a tensor on the emulated tpu device in place is not supported "
                f"(tensor of shape {tuple(t.shape)} became {tuple(t._local.shape)}); "
                "allocate the output with the right shape instead of relying on out= resizing"
            )


def _wrap_tree(out, device):
    if isinstance(out, torch.Tensor):
        return out if type(out) is TpuTensor else TpuTensor(out, device)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_tree(o, device) for o in out)
    return out


# ----------------------------------------------------------------------------- special-cased ops


def _to_copy(func, args, kwargs):
    src = args[0]
    dev = kwargs.get("device")
    kw = dict(kwargs)
    if dev is not None and torch.device(dev).type != DEVICE_TYPE:
        # tpu -> cpu (or another device): a plain tensor.
        return func(local_tensor(src), **kw)
    kw["device"] = _CPU
    if dev is None:
        target = src.device
    else:
        target = _target_device(dev)
    return TpuTensor(func(local_tensor(src), **kw), target)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    local_tensor(dst).copy_(local_tensor(src), *args[2:], **kwargs)
    return dst


def _resize_(func, args, kwargs):
    t, size = args[0], args[1]
    if tuple(t.shape) == tuple(size):
        return t
    raise RuntimeError(
        f"resize_ from {tuple(t.shape)} to {tuple(size)} is not supported on the emulated tpu device; "
        "allocate a tensor of the right shape instead"
    )


def _is_pinned(func, args, kwargs):
    return False


_SPECIAL = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.resize_.default: _resize_,
    aten.is_pinned.default: _is_pinned,
}


# ------------------------------------------------------------------- PrivateUse1 factory kernels

# Ops with no tensor argument reach the PrivateUse1 kernel directly (there is no wrapper to route
# them to __torch_dispatch__). Each kernel runs the CPU op and wraps the result.
FACTORY_OPS = (
    "empty.memory_format",
    "empty_strided",
    "zeros",
    "ones",
    "full",
    "scalar_tensor",
    "arange",
    "arange.start",
    "arange.start_step",
    "linspace",
    "logspace",
    "eye",
    "eye.m",
    "rand",
    "rand.generator",
    "randn",
    "randn.generator",
    "randint",
    "randint.low",
    "randint.generator",
    "randint.low_generator",
    "randperm",
    "randperm.generator",
    "normal.float_float",
    "tril_indices",
    "triu_indices",
)

_LIB: torch.library.Library | None = None


def _factory_kernel(op):
    def kernel(*args, **kwargs):
        target = _target_device(kwargs.get("device") or DEVICE_TYPE)
        kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        return TpuTensor(op(*args, **kwargs), target)

    return kernel


def _copy_from(src, dst, non_blocking=False):
    local_tensor(dst).copy_(local_tensor(src))
    return dst


def register_kernels() -> None:
    """Register the PrivateUse1 ("tpu") factory kernels with torch.library (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name in FACTORY_OPS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        lib.impl(name, _factory_kernel(op), "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _LIB = lib
