"""torch.compile backends for the engine's step programs on a real TPU: the KV cache updated where it lies.

torch_tpu's own backend ("tpu") runs AOTAutograd with `keep_inference_input_mutations=False`: a program
that writes into one of its inputs (the KV cache) returns the whole updated tensor as an extra output and
AOTAutograd copies it back into the input afterwards, so every step copies every layer's cache (twice:
into a fresh output buffer, then back) where one token per sequence changed.

"tpu-donate" is the same static compiler with the mutated inputs *donated* (torch_tpu's
`StaticCompiler(donated_inputs=...)`, XLA's input/output aliasing): the program's updated cache reuses
the input's buffer, so XLA writes the new rows in place, and AOTAutograd's copy back into the input is
free (torch_tpu re-points the buffer). Measured on a v5e (the donation probe, `benchmarks/notes/real-tpu.md`): one row
written into a 1 GiB cache, 5.6 ms per call with "tpu", 2.1 ms donated (1.8 ms for a program that only
reads). Keeping the mutation inside the program instead (`keep_inference_input_mutations=True`, donated
or not) loses the writes on torch_tpu 0.2.0. It is the default of a compiled one-chip runner on a real
TPU (runner.default_backend); `bench_real_tpu.py engine --compile-backend tpu,tpu-donate` compares.

Its programs serialize as torch_tpu's own backend's do (a `SerializableAOTDispatchCompiler` returning
torch_tpu's `CompiledArtifact`), so the runner saves them whole (programs.py).

It lowers without the MLIR location tracebacks torch_tpu otherwise captures for every op of a compiled
graph (engine/tpu_lowering.py: a step program's first call 0.50-0.55x on the v5e).

Uses torch_tpu internals (`torch_tpu._internal.compile`, written against 0.2.0); where they are missing
the backend raises ImportError naming the version. Graphs with collectives (tensor parallelism) are
refused: torch_tpu splits those with a compiler that does not take donations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tpuray.serve.llm.engine.tpu_lowering import tracebacks_kept, without_tracebacks
from tpuray.serve.llm.engine.tpu_programs import TESTED_TORCH_TPU

DONATING = ("tpu-donate",)


def _torch_tpu_internals(name: str) -> tuple[Any, Any, Any, Any]:
    try:
        from torch_tpu._internal import execution_mode
        from torch_tpu._internal.compile import _backend as tpu_backend
        from torch_tpu._internal.compile import compiler, tpu_torch_compile
    except ImportError as e:
        raise ImportError(
            f"compile_backend={name!r} needs torch_tpu {TESTED_TORCH_TPU}'s compiler internals ({e}); "
            "use compile_backend='tpu', or leave it unset off a TPU"
        ) from e
    return execution_mode, tpu_backend, compiler, tpu_torch_compile


def _mutated_inputs(graph: Any) -> list[int]:
    """Indices of the forward graph's inputs that the program writes into (AOTAutograd's metadata of the
    graph being compiled; their updated values come back as outputs)."""
    from torch._guards import TracingContext

    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return []
    return [i for i, info in enumerate(meta.input_info) if info.mutates_data and i < len(placeholders)]


def _has_collectives(gm: Any) -> bool:
    return any("c10d" in str(getattr(n, "target", "")) for n in gm.graph.nodes if n.op == "call_function")


def donating_backend(
    name: str, async_compile: bool = False, mlir_tracebacks: bool = False
) -> Callable[..., Any]:
    """The torch.compile backend `name` (one of DONATING); with `async_compile`, torch_tpu's compiler
    lowers and compiles each program in its background threads (the program waits for it when first
    called or saved); `mlir_tracebacks` lowers with torch_tpu's per-op tracebacks (also on where
    TORCH_TRACE is set)."""
    if name not in DONATING:
        raise ValueError(f"unknown donating backend {name!r}; expected one of {DONATING}")
    execution_mode, tpu_backend, compiler_module, state = _torch_tpu_internals(name)
    mlir_tracebacks = mlir_tracebacks or tracebacks_kept()

    def backend(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        if kwargs.get("options"):
            raise ValueError(f"compile_backend={name!r} takes no options; got {sorted(kwargs['options'])}")
        if _has_collectives(gm):
            raise NotImplementedError(f"compile_backend={name!r} compiles single-chip programs only")
        compiler = compiler_module.StaticCompiler(async_compile=async_compile)
        if not mlir_tracebacks:
            compiler._compile = without_tracebacks(compiler._compile, state)
        compiler.execute_pre_grad_passes(gm)

        def forward(graph: Any, inputs: Sequence[Any]) -> Any:
            donated = _mutated_inputs(graph)
            return compiler(graph, inputs, True, donated_inputs=donated, module_name="tpuray_step")

        def backward(graph: Any, inputs: Sequence[Any]) -> Any:
            return compiler(graph, inputs, False, module_name="tpuray_step_backward")

        # torch_tpu's own backend's way to a serializable program: its context makes AOTAutograd build the
        # bundled cache entry, handed out as `serialize` (what torch.compile's aot_compile saves)
        with tpu_backend._serialization_context(example_inputs, True) as captured:
            with execution_mode.set_eager_mode(execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
                result = aot_autograd(  # OutputCode compilers: the program can be saved (programs.py)
                    **aot_compilers(compiler_module.CompiledArtifact, forward, backward),
                    decompositions=tpu_backend._TPU_DECOMPOSITIONS,
                    keep_inference_input_mutations=False,
                )(gm, example_inputs)
        if captured and captured[0] is not None:
            entry = captured[0]
            result.serialize = lambda: entry  # type: ignore[attr-defined]  # as torch_tpu does
        return result

    return backend


def aot_compilers(
    artifact: type, forward: Callable[..., Any], backward: Callable[..., Any]
) -> dict[str, Any]:
    """AOTAutograd's forward and backward compilers, each an object of its own. Given no backward
    compiler, AOTAutograd uses the forward's object for it and wraps that object's function in
    `torch._dynamo.disable` (torch's backends/common.py), which looks an attribute up on every program
    the forward compiler returns: on torch_tpu's AsyncCompiledArtifact that lookup waits for the
    program's background compilation, so the next program would be traced only once this one is built
    (86.5 s of waiting in a first start of the 1.1B model on the v5e). torch_tpu's own backend passes a
    backward compiler too."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return {
        "fw_compiler": SerializableAOTDispatchCompiler(artifact, forward),
        "bw_compiler": SerializableAOTDispatchCompiler(artifact, backward),
    }


def lookup(name: str, async_compile: bool = False) -> Callable[..., Any]:
    """The torch.compile backend callable for `name`: one of DONATING, or any name in Dynamo's registry
    ("tpu", "inductor", "eager", ...); `async_compile` for DONATING only."""
    if name in DONATING:
        return donating_backend(name, async_compile)
    if async_compile:
        raise ValueError(f"async_compile needs a backend in {DONATING}; got {name!r}")
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)
