"""torch.compile backends for the engine's step programs on a real TPU.

torch_tpu's own backend ("tpu") runs AOTAutograd with `keep_inference_input_mutations=False`: a program
that writes into one of its inputs (the KV cache) returns the updated tensor as an extra output, and
AOTAutograd copies it back into the input after the program. For a KV cache that is a full copy of every
layer's cache per step, twice (the program writes a fresh output buffer, then `copy_` back), where one
token per sequence changed.

"tpu-inplace" is the same compiler with the mutations kept inside the program (AOTAutograd
`keep_inference_input_mutations=True`): the write into the cache is the program's own in-place update of
its input, which torch_tpu's tracer turns into a donated buffer (XLA updates it where it lies). Which
backend the engine uses is `ModelRunner(compile_backend=...)`; `bench_real_tpu.py engine
--compile-backend` measures both on the chip.

Uses torch_tpu internals (`torch_tpu._internal.compile`, 0.2.0); where they are missing the backend
raises ImportError naming the version it was written against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

BACKENDS = ("tpu", "tpu-inplace")
TESTED_TORCH_TPU = "0.2.0"


def _torch_tpu_compiler() -> tuple[Any, Any]:
    try:
        from torch_tpu._internal import execution_mode
        from torch_tpu._internal.compile import _backend as tpu_backend
    except ImportError as e:
        raise ImportError(
            f"compile_backend='tpu-inplace' needs torch_tpu {TESTED_TORCH_TPU}'s compiler internals "
            f"({e}); use compile_backend='tpu', or leave it unset off a TPU"
        ) from e
    return execution_mode, tpu_backend


def tpu_inplace_backend(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """A torch.compile backend: torch_tpu's static compiler, with input mutations kept in the program."""
    from torch._dynamo.backends.common import aot_autograd

    execution_mode, tpu_backend = _torch_tpu_compiler()
    if kwargs.get("options"):
        raise ValueError(f"compile_backend='tpu-inplace' takes no options; got {sorted(kwargs['options'])}")
    compiler = tpu_backend.make_backend_compiler(example_inputs)
    compiler.execute_pre_grad_passes(gm)

    def forward(graph: Any, inputs: Sequence[Any]) -> Any:
        return compiler(graph, inputs, True, module_name="tpuray_step")

    with execution_mode.set_eager_mode(execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
        return aot_autograd(
            fw_compiler=forward,
            decompositions=tpu_backend._TPU_DECOMPOSITIONS,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def lookup(name: str) -> Callable[..., Any]:
    """The torch.compile backend callable for `name` ("tpu-inplace" here, any other name from Dynamo's
    registry: "tpu", "inductor", ...)."""
    if name == "tpu-inplace":
        _torch_tpu_compiler()  # fail at construction, not at the first step
        return tpu_inplace_backend
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)
