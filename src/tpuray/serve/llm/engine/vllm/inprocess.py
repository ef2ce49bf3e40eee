"""vLLM's engine core in the caller's process: `in_process_async_llm` builds vLLM's AsyncLLM (the client a
serving replica drives, with vLLM's own OpenAI layer on top) over an `AsyncInprocClient`, vLLM's
`InprocClient` (the in-process EngineCore of its synchronous LLMEngine) given AsyncLLM's async interface.

Why: AsyncLLM always starts its engine core as a child process (vLLM 0.29 refuses asyncio without
multiprocessing). On a machine where only one process may hold the accelerator and no TCP socket opens
(a one-chip TPU VM), the engine core, its one worker and the model must live in the process that serves:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own switch for its synchronous engine, selects this mode for
tpuray's engine too (tpuray.serve.llm.engine.vllm.engine).

Every call into the engine core (add, abort, step, collective_rpc, sleep, ...) runs on one thread of its
own, in order, so the event loop never blocks on a model step; `get_output_async` steps the core there
while it has work and otherwise waits for the next request. An exception from a step marks the engine
dead: the step's caller gets vLLM's EngineDeadError, as from a dead engine-core process.

vLLM's worker joins a one-rank torch.distributed world, and its CPU group is gloo, which opens a TCP socket
even alone. Where TCP sockets cannot be opened, the one-rank gloo groups made while the engine starts use
torch's socket-free "fake" backend instead (a one-rank collective moves no data; vLLM skips them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tpuray.serve.llm.engine.tpu_lowering import tracebacks_off_in_this_thread
from tpuray.serve.llm.engine.tpu_programs import programs_loaded_lightly

logger = logging.getLogger(__name__)

# InprocClient methods AsyncLLM calls as `<name>_async`, run on the engine core's thread.
_ON_CORE = (
    "get_supported_tasks", "abort_requests", "profile", "reset_mm_cache", "reset_prefix_cache",
    "reset_encoder_cache", "sleep", "wake_up", "is_sleeping", "add_lora", "remove_lora", "list_loras",
    "pin_lora", "save_sharded_state", "collective_rpc", "execute_dummy_batch", "set_weight_version",
    "get_weight_version",
)  # fmt: skip


def tcp_available() -> bool:
    """Whether this process can open a TCP socket (a TPU test VM allows none, not even on loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def one_rank_groups_without_tcp() -> Iterator[None]:
    """While the engine starts: where no TCP socket opens, a one-rank gloo process group (vLLM's world and
    CPU groups) is made with torch's "fake" backend; elsewhere nothing changes."""
    if tcp_available():
        yield
        return
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    init, new = dist.init_process_group, dist.new_group

    def gloo(backend: Any) -> bool:
        return backend is None or str(backend).lower() in ("gloo", "cpu:gloo")

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if gloo(backend) and kwargs.get("world_size", 1) == 1:
            backend = "fake"
        return init(backend, *args, **kwargs)

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, *args: Any, **kw: Any) -> Any:
        if gloo(backend) and dist.get_world_size() == 1:
            backend = "fake"
        return new(ranks, timeout, backend, *args, **kw)

    dist.init_process_group, dist.new_group = init_process_group, new_group
    logger.info("no TCP sockets here: vLLM's one-rank gloo groups use torch's fake backend")
    try:
        yield
    finally:
        dist.init_process_group, dist.new_group = init, new


@dataclass
class _Resources:
    """What AsyncLLM reads of its client's resources (`errored`)."""

    engine_dead: bool = False


def _on_core(name: str) -> Callable[..., Any]:
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._run(functools.partial(getattr(self._core, name), *args, **kwargs))

    method.__name__ = f"{name}_async"
    return method


def _start_core(vllm_config: Any, executor_class: type, log_stats: bool) -> Any:
    """vLLM's InprocClient, its compiled graphs loaded without copies or stacks (tpu_programs.py)."""
    from vllm.v1.engine.core_client import InprocClient

    with programs_loaded_lightly():
        return InprocClient(vllm_config, executor_class, log_stats)


class AsyncInprocClient:
    """AsyncLLM's engine-core client over vLLM's InprocClient (the EngineCore in this process)."""

    def __init__(self, vllm_config: Any, executor_class: type, log_stats: bool) -> None:
        self.resources = _Resources()
        self.engine_ranks_managed = [0]
        # vLLM-TorchTPU lowers every graph in this thread: without MLIR tracebacks (tpu_lowering.py)
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="vllm-engine-core", initializer=tracebacks_off_in_this_thread
        )
        self._work: asyncio.Event | None = None
        try:
            self._core = self._thread.submit(_start_core, vllm_config, executor_class, log_stats).result()
        except BaseException:
            self._thread.shutdown(wait=False)
            raise

    async def _run(self, fn: Callable[[], Any]) -> Any:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.resources.engine_dead:
            raise EngineDeadError()
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def _event(self) -> asyncio.Event:
        if self._work is None:
            self._work = asyncio.Event()
        return self._work

    def _step(self) -> Any:
        """One engine step where the core has work (None where it has none), on the core's thread."""
        from vllm.v1.engine.exceptions import EngineDeadError

        core = self._core.engine_core  # has work: EngineCoreProc.has_work's test, for one engine
        if not (core.scheduler.has_requests() or core.batch_queue):
            return None
        try:
            return self._core.get_output()
        except Exception as e:
            self.resources.engine_dead = True
            logger.exception("vLLM's in-process engine core failed a step")
            raise EngineDeadError(f"the in-process engine core failed: {type(e).__name__}: {e}") from e

    async def get_output_async(self) -> Any:
        while True:
            outputs = await self._run(self._step)
            if outputs is not None:
                return outputs
            await self._event().wait()
            self._event().clear()

    async def add_request_async(self, request: Any) -> None:
        await self._run(functools.partial(self._core.add_request, request))
        self._event().set()

    async def collective_rpc_async(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return await self._run(functools.partial(self._core.collective_rpc, method, timeout, args, kwargs))

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine core (its worker and model) and leave vLLM's distributed state, so that a
        later engine (or another user of torch.distributed) can start in this process."""
        if self._thread is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        thread, self._thread = self._thread, None
        try:
            thread.submit(self._core.shutdown).result(timeout)
            thread.submit(cleanup_dist_env_and_memory).result(timeout)
        finally:
            thread.shutdown(wait=False)
            self.resources.engine_dead = True


for _name in _ON_CORE:
    if _name != "collective_rpc":
        setattr(AsyncInprocClient, f"{_name}_async", _on_core(_name))


def in_process_async_llm(vllm_config: Any, executor_class: type, log_stats: bool, log_requests: bool) -> Any:
    """vLLM's AsyncLLM with its engine core in this process (`AsyncInprocClient`).

    AsyncLLM makes its client with `EngineCoreClient.make_async_mp_client`, which starts a process; while
    this AsyncLLM is built, that factory makes the in-process client instead (vLLM has no argument for it)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import EngineCoreClient

    def make_in_process(vllm_config: Any, executor_class: type, log_stats: bool, **_: Any) -> Any:
        return AsyncInprocClient(vllm_config, executor_class, log_stats)

    factory = EngineCoreClient.__dict__["make_async_mp_client"]
    EngineCoreClient.make_async_mp_client = staticmethod(make_in_process)
    try:
        with one_rank_groups_without_tcp():
            return AsyncLLM(
                vllm_config=vllm_config,
                executor_class=executor_class,
                log_stats=log_stats,
                log_requests=log_requests,
            )
    finally:
        EngineCoreClient.make_async_mp_client = factory
