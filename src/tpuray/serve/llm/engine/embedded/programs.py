"""A compiled runner's step programs: one per bucket shape, built ahead of time and kept on the host's disk.

Each program (a prefill of T tokens, a decode of B rows over L positions) is built by torch.compile's
ahead-of-time API (`aot_compile`: Dynamo's graph capture, AOTAutograd, the backend's compiler) and saved
in the host's compilation cache (`compile_cache.ProgramStore`). An engine started again loads each
program whole instead of tracing, lowering and compiling it: the warm-up of a second start reads files.

Saving needs a backend whose executables serialize: SAVABLE_BACKENDS (torch_tpu's "tpu" and tpuray's
"tpu-donate", whose executables torch_tpu pickles; Inductor on a CPU). With another backend ("eager")
or the cache off, the programs are plain torch.compile'd functions that Dynamo dispatches by shape.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tpuray.serve.llm.engine.compile_cache import ProgramStore
from tpuray.serve.llm.engine.embedded.tpu_compile import lookup

logger = logging.getLogger(__name__)

SAVABLE_BACKENDS = ("tpu-donate", "tpu", "inductor")
ASYNC_BACKENDS = ("tpu-donate",)  # whose compiler lowers and compiles in background threads

Program = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


@contextlib.contextmanager
def backend_code_shared() -> Iterator[None]:
    """While it lasts, a deep copy of a backend's compiled code (torch's `OutputCode`: torch_tpu's
    executables, Inductor's graphs) is the object itself. torch's loader deep-copies a loaded program's
    cache entry "in case it needs to be serialized again" (`deserialize_bundled_cache_entry`), which for
    torch_tpu serializes each executable and loads it onto the device a second time, held as long as the
    program; a loaded program is never saved again here, so the copy shares it instead. Enter it on the
    thread that loads (or starts the loading threads), with no other deep copy of such code under way."""
    from torch._inductor.output_code import OutputCode

    added = [c for c in _subclasses(OutputCode) if c not in copy._deepcopy_dispatch]  # type: ignore[attr-defined]
    for c in added:
        copy._deepcopy_dispatch[c] = copy._deepcopy_atomic  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for c in added:
            copy._deepcopy_dispatch.pop(c, None)  # type: ignore[attr-defined]


@contextlib.contextmanager
def torch_cache_unwritten(deferred: list[Any] | None = None) -> Iterator[None]:
    """While it lasts, AOTAutograd prepares a compiled program's cache entry for serialization but neither
    pickles it nor writes it into torch's own cache (`AOTAutogradCache.save`, which aot_compile turns on):
    the program store saves the entry itself, and for torch_tpu each pickle serializes the executable (a
    second copy of every program on disk, and its time, at every first start). With `deferred`, the
    entries are appended there unprepared (preparing an entry waits for a compilation in the background:
    the caller prepares them before saving)."""
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
        if deferred is None:
            entry.pre_save()
        else:
            deferred.append(entry)

    AOTAutogradCache.save = staticmethod(prepare_only)  # type: ignore[method-assign]
    try:
        yield
    finally:
        AOTAutogradCache.save = original  # type: ignore[method-assign]


class StepPrograms:
    """The prefill and decode programs of `prefill(packed, num_prompts)` and `decode(packed, context_len)`
    (bound methods of the runner), compiled with the backend `backend_name`. `compiled` counts programs
    built by the compiler, `loaded` those read from `store`."""

    def __init__(
        self,
        prefill: Program,
        decode: Program,
        backend_name: str,
        store: ProgramStore | None,
        async_compile: bool = False,
    ):
        self.store = store if backend_name in SAVABLE_BACKENDS else None
        if async_compile and (backend_name not in ASYNC_BACKENDS or self.store is None):
            raise ValueError(
                f"async_compile=True needs compile_backend in {ASYNC_BACKENDS} and the compilation cache on "
                f"(TPURAY_COMPILE_CACHE not 'off'); got compile_backend={backend_name!r}, "
                f"cache {'on' if store else 'off'}"
            )
        self.async_compile = async_compile
        backend = lookup(backend_name, async_compile=async_compile)
        self.compiled = 0
        self.loaded = 0
        self._sources = {"prefill": prefill, "decode": decode}
        self._programs: dict[str, Program] = {}
        self._preloaded: dict[str, Any] = {}  # saved programs read by `preload`, not yet checked
        self._unsaved_entries: dict[
            str, tuple[Any, list[Any]]
        ] = {}  # built by `build`, saved by `save_built`

        def counting(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            self.compiled += 1
            return backend(gm, example_inputs, **kwargs)

        self._backend = counting
        self._dynamo: dict[str, Program] = {}
        if self.store is None:
            self._dynamo = {k: self._compiler(fn) for k, fn in self._sources.items()}
        # loaded executables freed while the device runtime lives: torch_tpu 0.2.0 crashes (SIGSEGV) when
        # the interpreter's last garbage collection frees them after its runtime is gone
        atexit.register(StepPrograms._release, weakref.ref(self))

    @staticmethod
    def _release(ref: weakref.ref[StepPrograms]) -> None:
        programs = ref()
        if programs is not None:
            programs.close()

    def close(self) -> None:
        """Drop the compiled programs (at the interpreter's exit, or by their owner)."""
        self._programs.clear()
        self._dynamo.clear()
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
        with backend_code_shared(), ThreadPoolExecutor(workers, thread_name_prefix="tpuray-load") as pool:
            self._preloaded.update(zip(saved, pool.map(store.load, saved), strict=True))

    def build(self, kinds_and_args: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Build every program of `kinds_and_args` ("prefill" or "decode", and its inputs) before running
        any: with async_compile, torch_tpu lowers and compiles each one in the background while the next
        is traced. `save_built` then saves those compiled here (waiting for each)."""
        for kind, args in kinds_and_args:
            name = self.name(kind, args)
            if self.store is not None and name not in self._programs:
                self._programs[name] = self._build(kind, name, args, defer_save=True)

    def save_built(self) -> None:
        assert self.store is not None or not self._unsaved_entries
        for name, (program, entries) in self._unsaved_entries.items():
            for entry in entries:
                entry.pre_save()
            if self.store is not None:
                self.store.save(name, program)
        self._unsaved_entries.clear()

    def _run(self, kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.store is None:
            return self._dynamo[kind](*args)
        name = self.name(kind, args)
        program = self._programs.get(name)
        if program is None:
            program = self._programs[name] = self._build(kind, name, args)
        return program(*args)

    def _build(self, kind: str, name: str, args: tuple[Any, ...], defer_save: bool = False) -> Program:
        """The program `name`: loaded from the store when it holds one whose guards accept these inputs,
        else compiled ahead of time and saved. The runner's bucket picks the program, so its guards are
        checked once here, not at every step."""
        assert self.store is not None
        source = self._sources[kind]
        owner = source.__self__  # type: ignore[attr-defined]  # the runner: the program's `self`
        if name in self._preloaded:
            program = self._preloaded.pop(name)
        else:
            with backend_code_shared():
                program = self.store.load(name)
        if program is not None and self._accepts(program, name, owner, args):
            self.loaded += 1
        else:
            deferred: list[Any] | None = [] if defer_save else None
            try:
                with torch_cache_unwritten(deferred):
                    program = self._compiler(source).aot_compile((args, {}))
            except RuntimeError as e:  # the backend's program is not serializable: Dynamo dispatches
                if "SerializableCallable" not in str(e):
                    raise
                return self._unsaved(e)[kind]
            if deferred is None:
                self.store.save(name, program)
            else:
                self._unsaved_entries[name] = (program, deferred)
        program.disable_guard_check()
        return functools.partial(program, owner)

    def _unsaved(self, error: Exception) -> dict[str, Program]:
        logger.warning(
            "compilation cache: this backend's programs cannot be saved (%s); compiling in memory", error
        )
        self.store, self._programs = None, {}
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
