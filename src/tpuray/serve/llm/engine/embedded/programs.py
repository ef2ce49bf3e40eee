"""A compiled runner's step programs: one per bucket shape, built ahead of time and kept on the host's disk.

Each program (a prefill of T tokens, a decode of B rows over L positions) is built by torch.compile's
ahead-of-time API (`aot_compile`: Dynamo's graph capture, AOTAutograd, the backend's compiler) and saved
in the host's compilation cache (`compile_cache.ProgramStore`). An engine started again loads each
program whole instead of tracing, lowering and compiling it: the warm-up of a second start reads files.
(vLLM keeps its compiled model the same way, VLLM_USE_AOT_COMPILE, which vLLM-TorchTPU keys by chip.)

Saved: the programs a warm-up builds (its padding inputs are the ones torch_tpu's passes may specialize
on safely: runner.warmup_prefill), with the backends a real engine runs, SAVABLE_BACKENDS (torch_tpu's
"tpu" and tpuray's "tpu-donate", whose executables torch_tpu pickles; Inductor on a CPU), on one chip
(a tensor-parallel program names its process group inside the graph: not saved until a slice test loads
one). Otherwise ("eager" and other debugging backends, tensor parallelism, the cache off) the programs are
plain torch.compile'd functions that Dynamo dispatches by shape, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tpuray.serve.llm.engine.compile_cache import ProgramStore
from tpuray.serve.llm.engine.embedded.tpu_compile import lookup
from tpuray.serve.llm.engine.tpu_programs import (
    backend_code_shared,
    executables_not_copied,
    fake_modes_without_stacks,
)

logger = logging.getLogger(__name__)

SAVABLE_BACKENDS = ("tpu-donate", "tpu", "inductor")
ASYNC_BACKENDS = ("tpu-donate",)  # whose compiler lowers and compiles in background threads

Program = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@contextlib.contextmanager
def torch_cache_unwritten(deferred: list[Any] | None = None) -> Iterator[None]:
    """While it lasts, AOTAutograd prepares a compiled program's cache entry for serialization but neither
    pickles it nor writes it into torch's own cache (`AOTAutogradCache.save`, which aot_compile turns on):
    the program store saves the entry itself, and for torch_tpu each pickle serializes the executable (a
    second copy of every program on disk, and its time, at every first start). With `deferred`, the
    entries are appended there unprepared (preparing one may wait for its compilation in the background:
    the caller prepares them before saving, as `save_built` does). Process-wide while it lasts, as
    torch_tpu's own async saves are: another thread's compilation meanwhile writes nothing into torch's
    cache either."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    except ImportError:  # another torch: its cache is written as before
        yield
        return
    original = AOTAutogradCache.__dict__.get("save")
    if original is None:
        yield
        return

    def prepare_only(key: str, entry: Any, remote: bool) -> None:
        if deferred is not None:
            deferred.append(entry)
            return
        try:
            with executables_not_copied():
                entry.pre_save()
        except Exception as e:  # noqa: BLE001 - torch's save logs and goes on too: the save fails later
            logger.warning("compilation cache: cannot prepare a program for saving (%s)", e)

    AOTAutogradCache.save = staticmethod(prepare_only)  # type: ignore[method-assign]
    try:
        yield
    finally:
        AOTAutogradCache.save = original  # type: ignore[method-assign]


class StepPrograms:
    """The prefill and decode programs of `prefill(packed, num_prompts)` and `decode(packed, context_len)`
    (bound methods of the runner's StepFunctions), compiled with the backend `backend_name`, saved under
    `store_key` (None: not saved). `compiled` counts programs built by the compiler, `loaded` those read
    from the store (`preloaded` of them by `preload`'s threads)."""

    def __init__(
        self,
        prefill: Program,
        decode: Program,
        backend_name: str,
        store_key: Mapping[str, Any] | None,
        async_compile: bool | None = None,
    ):
        savable = backend_name in SAVABLE_BACKENDS
        self.store = ProgramStore.for_key(store_key) if store_key is not None and savable else None
        if async_compile is None:  # on where it applies (docs/real-tpu.md: the first start it shortens)
            async_compile = backend_name in ASYNC_BACKENDS and self.store is not None
        if async_compile and (backend_name not in ASYNC_BACKENDS or self.store is None):
            raise ValueError(
                f"async_compile=True needs compile_backend in {ASYNC_BACKENDS}, one chip and the compilation "
                f"cache on (TPURAY_COMPILE_CACHE not 'off'); got compile_backend={backend_name!r}, "
                f"{'a saving store' if self.store else 'nothing saved'}"
            )
        self.async_compile = async_compile
        backend = lookup(backend_name, async_compile=async_compile)
        self.compiled = self.loaded = self.preloaded = 0
        self._sources = {"prefill": prefill, "decode": decode}
        self._programs: dict[str, Program] = {}
        self._preloaded: dict[str, Any] = {}  # saved programs read by `preload`, not yet checked
        self._unproven: set[str] = set()  # loaded programs not yet run once
        self._unsaved: dict[str, tuple[Any, list[Any]]] = {}  # built by `build`, saved by `save_built`

        def counting(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            self.compiled += 1
            return backend(gm, example_inputs, **kwargs)

        self._backend = counting
        self._dynamo: dict[str, Program] = {}
        if self.store is None:
            self._dynamo = {k: self._compiler(fn) for k, fn in self._sources.items()}
        # loaded executables freed while the device runtime lives: torch_tpu 0.2.0 crashes (SIGSEGV) when
        # the interpreter's last garbage collection frees them after its runtime is gone
        self._at_exit = functools.partial(StepPrograms._release, weakref.ref(self))
        atexit.register(self._at_exit)

    @staticmethod
    def _release(ref: weakref.ref[StepPrograms]) -> None:
        programs = ref()
        if programs is not None:
            programs.close()

    def close(self) -> None:
        """Drop the compiled programs (at the interpreter's exit, or by their owner)."""
        atexit.unregister(self._at_exit)
        for table in (self._programs, self._dynamo, self._preloaded, self._unsaved):
            table.clear()
        import gc

        gc.collect()

    def _compiler(self, fn: Program) -> Any:
        return torch.compile(fn, backend=self._backend, dynamic=False, fullgraph=True)

    def prefill(self, packed: torch.Tensor, num_prompts: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run("prefill", packed, num_prompts)

    def decode(self, packed: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run("decode", packed, context_len)

    @staticmethod
    def name(kind: str, args: tuple[Any, ...]) -> str:
        """The program's name of a step of `kind` ("prefill", "decode") on `args`: its packed inputs, and
        the prompts per pack or the context length (the bucket: one program each)."""
        packed, size = args
        return f"{kind}-{packed.shape[-1]}x{size}"

    def preload(self, names: list[str], workers: int) -> None:
        """Read the saved programs among `names` from the store with `workers` threads, ahead of their
        first call (which checks and keeps them)."""
        if self.store is None or workers < 2:
            return
        store = self.store
        saved = [n for n in names if n not in self._programs and store.path(n).exists()]
        with (
            backend_code_shared(),
            fake_modes_without_stacks(),
            ThreadPoolExecutor(workers, thread_name_prefix="tpuray-load") as pool,
        ):
            self._preloaded.update(zip(saved, pool.map(store.load, saved), strict=True))

    def build(self, kinds_and_args: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Build (load, or compile to save) every program of `kinds_and_args` ("prefill" or "decode", and
        its warm-up inputs) before running any: with async_compile, torch_tpu lowers and compiles each one
        in the background while the next is traced. `save_built` then saves those compiled here."""
        for i, (kind, args) in enumerate(kinds_and_args, 1):
            name = self.name(kind, args)
            if self.store is not None and name not in self._programs:
                start = time.perf_counter()
                program = self._load(kind, name, args)
                how = "loaded" if program is not None else "submitted" if self.async_compile else "compiled"
                self._programs[name] = program or self._compile(kind, name, args, True)
                logger.info(
                    "warm-up: program %d of %d (%s) %s in %.1f s",
                    i,
                    len(kinds_and_args),
                    name,
                    how,
                    time.perf_counter() - start,
                )

    def save_built(self) -> None:
        """Save the programs `build` compiled (each waits for its compilation first, with async_compile)."""
        with executables_not_copied():
            for name, (program, entries) in self._unsaved.items():
                for entry in entries:
                    entry.pre_save()
                if self.store is not None:
                    self.store.save(name, program)
        self._unsaved.clear()

    def _run(self, kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.store is None:
            return self._dynamo[kind](*args)
        name = self.name(kind, args)
        program = self._programs.get(name)
        if program is None:  # outside a warm-up: kept in memory only (module docstring)
            program = self._programs[name] = self._load(kind, name, args) or self._compile(kind, name, args)
        if name not in self._unproven:
            return program(*args)
        self._unproven.discard(name)
        try:
            return program(*args)
        except Exception as e:  # noqa: BLE001 - a saved program that cannot run here is compiled again
            logger.warning("compilation cache: %s failed its first run (%s); compiling it again", name, e)
            assert self.store is not None
            self.store.path(name).unlink(missing_ok=True)
            self.loaded -= 1
            program = self._programs[name] = self._compile(kind, name, args)
            return program(*args)

    def _bind(self, kind: str, program: Any) -> Program:
        """The program called as the source's bound method was; its guards checked once (the runner's
        bucket picks the program, so not at every step)."""
        program.disable_guard_check()
        return functools.partial(program, self._sources[kind].__self__)  # type: ignore[attr-defined]

    def _load(self, kind: str, name: str, args: tuple[Any, ...]) -> Program | None:
        """The saved program `name` when the store holds one whose guards accept these inputs."""
        assert self.store is not None
        owner = self._sources[kind].__self__  # type: ignore[attr-defined]  # the program's `self`
        if name in self._preloaded:
            program = self._preloaded.pop(name)
            self.preloaded += program is not None
        else:
            with backend_code_shared(), fake_modes_without_stacks():  # tpu_programs.py
                program = self.store.load(name)
        if program is None or not self._accepts(program, name, owner, args):
            return None
        self.loaded += 1
        self._unproven.add(name)
        return self._bind(kind, program)

    def _compile(self, kind: str, name: str, args: tuple[Any, ...], save: bool = False) -> Program:
        """The program `name` compiled ahead of time on `args`; with `save`, to be saved by `save_built`."""
        deferred: list[Any] | None = [] if save else None
        try:
            with torch_cache_unwritten(deferred):
                program = self._compiler(self._sources[kind]).aot_compile((args, {}))
        except RuntimeError as e:  # the backend's program is not serializable: Dynamo dispatches
            if "SerializableCallable" not in str(e):
                raise
            return self._in_memory(e)[kind]
        if deferred is not None:
            self._unsaved[name] = (program, deferred)
        return self._bind(kind, program)

    def _in_memory(self, error: Exception) -> dict[str, Program]:
        logger.warning(
            "compilation cache: this backend's programs cannot be saved (%s); compiling in memory", error
        )
        self.compiled -= 1  # compiled again by Dynamo
        self.store, self._programs, self._unsaved = None, {}, {}
        self._dynamo = {k: self._compiler(fn) for k, fn in self._sources.items()}
        return self._dynamo

    def _accepts(self, program: Any, name: str, owner: Any, args: tuple[Any, ...]) -> bool:
        try:
            if program.guard_check(owner, *args):
                return True
        except Exception as e:  # noqa: BLE001 - a saved program that cannot check its guards is a miss
            logger.warning("compilation cache: %s cannot check its guards (%s); compiling it again", name, e)
            return False
        logger.warning("compilation cache: %s was saved for other inputs; compiling it again", name)
        return False
