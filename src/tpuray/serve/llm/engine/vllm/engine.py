"""vLLM as the engine of one served model: `VLLMEngine` starts vLLM's AsyncLLM on the replica's slice.

With a TPU slice (accelerator_config), the engine reserves it with `tpuray.SlicePlacementGroup`, one
bundle `{"TPU": 1, "CPU": 1}` per chip, and hands that placement group to vLLM's Ray executor
(`parallel_config.placement_group`, as Ray Serve LLM does with its own), so tensor_parallel_size spans
the slice's chips: one vLLM worker per chip, TPU_VISIBLE_CHIPS set by Ray. On a real slice vLLM's TPU
platform (vllm-tpu / vLLM-TorchTPU) computes; on an EMULATED slice tpuray's vLLM platform plugin
(plugin.py) runs vLLM's CPU backend in those per-chip worker processes, and describe() and the logs
say so. Without an accelerator_config vLLM runs on this machine's device (its CPU, or the TPU chip of a
TPU VM) with its own executor.

vLLM's engine core is a child process of the replica, except where vLLM's multiprocessing is switched off
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own setting): then it runs in the replica's process
(inprocess.py), as on a one-chip TPU VM, where one process holds the chip and no TCP socket opens.

The OpenAI layer on top is vLLM's own (tpuray.serve.llm.backends.vllm).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from tpuray.constants import VLLM_PLATFORM_ENV
from tpuray.serve.llm import model_source
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine import compile_cache
from tpuray.serve.llm.engine.vllm.args import split_engine_kwargs
from tpuray.serve.llm.engine.vllm.plugin import EMULATED_TPU
from tpuray.serve.llm.engine.vllm.support import VLLMCannotServe, dtype_problem
from tpuray.validation import ConfigError

logger = logging.getLogger(__name__)

# vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB per worker) or, without it, from
# gpu_memory_utilization x host memory (default 0.92: all of it). Without either, tpuray asks for this.
DEFAULT_CPU_KVCACHE_GIB = "1"

SHUTDOWN_TIMEOUT_S = 10.0  # the most a replica waits for vLLM's client to stop (then it moves on)

# vLLM clients of engine cores that died: kept referenced for the life of the process, never collected,
# because collecting one blocks forever in its zmq context's clean-up (the process exits without it).
_DEAD_CLIENTS: list[Any] = []


def default_cpu_kv_cache(engine_args: Mapping[str, Any]) -> bool:
    """On vLLM's CPU backend, size the KV cache at DEFAULT_CPU_KVCACHE_GIB per worker
    (VLLM_CPU_KVCACHE_SPACE, for this process and its children) unless `engine_args` or the environment
    size it already; returns whether it did."""
    from vllm.platforms import current_platform

    if "gpu_memory_utilization" in engine_args or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return False
    if not current_platform.is_cpu():
        return False
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KVCACHE_GIB
    return True


def _ray_address() -> str | None:
    """The Ray cluster this process is connected to (None without one: Ray need not be installed)."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().gcs_address if ray is not None and ray.is_initialized() else None


class VLLMEngine:
    """One model's vLLM engine (AsyncLLM), and the slice its workers run on."""

    def __init__(
        self, config: LLMConfig, *, reservation_timeout_s: float = 120.0, record_kv_budget: bool | None = None
    ) -> None:
        """`record_kv_budget`: size vLLM's KV cache alike at every start (kv_budget.py); None: where vLLM
        compiles the model (not enforce_eager) on a device (not a CPU), with the compilation cache on."""
        self.config = config
        self.record_kv_budget = record_kv_budget
        self.spg: Any = None
        self.client: Any = None
        self.emulated = False
        self.in_process = False  # vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self.nodes: list[str] = []  # the slice's hosts, as reserved
        self.lost: BaseException | None = None  # a host of the slice died (engine core ended), or end()
        self.engine_args, self.frontend_args = split_engine_kwargs(config)
        try:
            if config.topology is not None:
                self._reserve(reservation_timeout_s)
            path = self._model_path()
            self._start(path, _ray_address())
        except BaseException:
            self.shutdown()
            raise

    # -- start ----------------------------------------------------------------------------------------
    def _reserve(self, timeout_s: float) -> None:
        from tpuray.slices import SlicePlacementGroup, holder_name, list_slices

        topo = self.config.topology
        assert topo is not None
        backend = self.engine_args.setdefault("distributed_executor_backend", "ray")
        if backend != "ray":
            raise ConfigError(
                f"engine_kwargs['distributed_executor_backend']={backend!r}: on a TPU slice vLLM's workers run "
                "on the slice's chips through its Ray executor; valid: 'ray'"
            )
        self.spg = SlicePlacementGroup(
            topology=topo.topology,
            accelerator_version=topo.generation.name,
            resources_per_bundle={"TPU": 1, "CPU": 1},
            timeout_s=timeout_s,
            name=holder_name("serve", self.config.model_id),
        )
        self.nodes = self.spg.node_ids()
        emulated = {s.name for s in list_slices() if s.emulated}
        self.emulated = bool(set(self.spg.slice_names) & emulated)
        if self.emulated:
            os.environ[VLLM_PLATFORM_ENV] = EMULATED_TPU  # this process and vLLM's engine core

    def _model_path(self) -> str:
        source = self.config.model_source
        if self.spg is None:
            return model_source.resolve(source)
        per_host = self.spg.num_bundles // self.spg.num_hosts
        return model_source.resolve_on_hosts(
            source,
            [self.spg.scheduling_strategy(b) for b in range(0, self.spg.num_bundles, per_host)],
            self.config.runtime_env,
        )

    def _start(self, path: str, ray_address: str | None) -> None:
        from vllm import envs as vllm_envs
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from tpuray.serve.llm.engine.vllm.inprocess import in_process_async_llm

        cfg = self.config
        if ray_address:  # vLLM's engine core is a Ray driver of its own: it must join this cluster
            os.environ["RAY_ADDRESS"] = ray_address
        if default_cpu_kv_cache(self.engine_args):
            logger.info(
                "%s: vLLM CPU backend KV cache %s GiB per worker", cfg.model_id, DEFAULT_CPU_KVCACHE_GIB
            )
        tokenizer = cfg.model_loading_config.tokenizer_source
        self.args = AsyncEngineArgs(
            model=path,
            tokenizer=model_source.resolve(tokenizer) if tokenizer else None,
            served_model_name=[cfg.model_id],
            **self.engine_args,
        )
        self._clear_platform_cache()
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():  # compiled programs kept on the host's disk (compile_cache.py)
            compile_cache.enable(vllm=True)
        vllm_config = self.args.create_engine_config()
        platform = type(current_platform).__name__
        problem = dtype_problem(self.engine_args.get("dtype"), vllm_config.model_config.dtype, platform)
        if problem:
            raise VLLMCannotServe(
                f"llm_engine={cfg.llm_engine!r} cannot serve model {cfg.model_id!r}: {problem}"
            )
        if self.spg is not None:
            vllm_config.parallel_config.placement_group = self.spg.placement_group
        self.in_process = not vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING
        make = in_process_async_llm if self.in_process else AsyncLLM
        self.client = make(
            vllm_config=vllm_config,
            executor_class=self._executor_class(vllm_config, current_platform.is_cpu()),
            log_stats=not self.args.disable_log_stats,
            log_requests=self.args.enable_log_requests,
        )
        self.vllm_config = vllm_config
        # an emulated slice is said where operators look (a warning reaches the replica's log by default)
        log = logger.warning if self.emulated else logger.info
        log("%s: vLLM engine up: %s", cfg.model_id, self.where())

    def _executor_class(self, vllm_config: Any, on_cpu: bool) -> type[Any]:
        """vLLM's executor for this config, as `RecordedKVBudget` where the KV cache is recorded."""
        from vllm.v1.executor.abstract import Executor

        from tpuray.serve.llm.engine.vllm import kv_budget

        compiled = not vllm_config.model_config.enforce_eager
        record = not on_cpu and compiled if self.record_kv_budget is None else self.record_kv_budget
        record = record and compile_cache.cache_dir() is not None
        user_key = kv_budget.sized_by_user(self.engine_args)
        if record and user_key is not None:
            logger.info("%s: vLLM's KV cache sized by engine_kwargs[%r]", self.config.model_id, user_key)
        elif record:
            return kv_budget.RecordedKVBudget
        return Executor.get_class(vllm_config)

    @staticmethod
    def _clear_platform_cache() -> None:
        """vLLM resolves its platform once per process; resolve again now that the env is set."""
        import vllm.platforms

        if getattr(vllm.platforms, "_current_platform", None) is not None:
            vllm.platforms._current_platform = None

    # -- info -----------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return int(self.vllm_config.model_config.max_model_len)

    def where(self) -> str:
        tp = self.config.tensor_parallel_size
        if self.spg is None:
            from vllm.platforms import current_platform

            core = "its engine core in this process" if self.in_process else "its engine core a child process"
            device = (
                "CPU (vLLM CPU backend)" if current_platform.is_cpu() else type(current_platform).__name__
            )
            return f"tensor_parallel_size={tp} on this machine's {device}, {core}"
        kind = (
            "EMULATED TPU chips: vLLM's CPU backend in per-chip worker processes" if self.emulated else "TPU"
        )
        return f"tensor_parallel_size={tp}, one vLLM worker per chip of {self.spg!r} ({kind})"

    def slice_nodes(self) -> list[str]:
        """The nodes of the engine's slice (none for vLLM in the replica's process)."""
        return self.spg.node_ids() if self.spg is not None else []

    def describe(self) -> dict[str, Any]:
        import vllm
        from vllm.platforms import current_platform

        bundles: list[str] = []
        if self.spg is not None:
            from ray.util.placement_group import placement_group_table

            table = placement_group_table(self.spg.placement_group)
            bundles = [table["bundles_to_node_id"].get(i, "") for i in range(self.spg.num_bundles)]
        return {
            "engine": "vLLM",
            "vllm_version": vllm.__version__,
            "platform": type(current_platform).__name__,
            "model": self.config.model_id,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "slice": repr(self.spg) if self.spg is not None else None,
            "placement_group_id": self.spg.placement_group.id.hex() if self.spg is not None else None,
            "bundle_nodes": bundles,  # the node of each per-chip bundle (one vLLM worker each)
            "emulated": self.emulated,
            "in_process": self.in_process,
            "where": self.where(),
            "engine_core_pids": self.engine_core_pids(),
        }

    def engine_core_pids(self) -> list[int]:
        """The process ids of vLLM's engine core (a child process of the replica; none in process)."""
        resources = getattr(getattr(self.client, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]

    async def check_health(self) -> None:
        """vLLM's own check, after ending the engine core when a host of the slice died: vLLM's Ray
        executor waits on a dead worker for minutes, so requests would hang; without its engine core,
        vLLM fails them (EngineDeadError) at once."""
        if self.nodes and self.lost is None:
            from tpuray.slices.drain import dead_nodes

            gone = await asyncio.to_thread(dead_nodes, self.nodes)
            if gone:
                self.lost = RuntimeError(f"host(s) {sorted(gone)} of the engine's TPU slice died")
                logger.error("%s: %s; ending vLLM's engine core", self.config.model_id, self.lost)
                for pid in self.engine_core_pids():
                    os.kill(pid, signal.SIGKILL)
        if self.lost is not None:
            raise self.lost
        await self.client.check_health()

    def engine_error(self) -> BaseException | None:
        """vLLM's EngineDeadError once its engine core died, or the loss of a host (None while it runs)."""
        client = self.client
        if self.lost is not None:
            return self.lost
        return client.dead_error if client is not None and client.errored else None

    def end(self, error: BaseException) -> None:
        """Fail the requests in flight with vLLM's EngineDeadError and report `error` as the engine's from
        then on (on the replica's event loop, before `shutdown`: a stopped client leaves its requests
        waiting). The replica's failover ends an engine whose slice reached its preemption deadline."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.lost is None:
            self.lost = error
        if self.client is not None:
            self.client.output_processor.propagate_error(EngineDeadError(str(error)))

    def shutdown(self) -> None:
        """Stop vLLM (engine core and its workers) and release the slice. Idempotent, and bounded: the
        client stops in a daemon thread given SHUTDOWN_TIMEOUT_S; a dead engine core's client is kept
        (`_DEAD_CLIENTS`) so that its zmq context is never collected."""
        client, self.client = self.client, None
        if client is not None:
            if client.errored:
                _DEAD_CLIENTS.append(client)
            stop = threading.Thread(target=_stop_client, args=(client,), name="vllm-shutdown", daemon=True)
            stop.start()
            stop.join(SHUTDOWN_TIMEOUT_S)
            if stop.is_alive():
                _DEAD_CLIENTS.append(client)
                logger.warning("vLLM's client did not stop within %ss; leaving it", SHUTDOWN_TIMEOUT_S)
        spg, self.spg = self.spg, None
        if spg is not None:
            spg.shutdown()


def _stop_client(client: Any) -> None:
    try:
        client.shutdown()
    except Exception:  # noqa: BLE001 - the slice must be released anyway
        logger.exception("vLLM engine shutdown failed")
