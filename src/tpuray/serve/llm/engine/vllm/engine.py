"""vLLM as the engine of one served model: `VLLMEngine` starts vLLM's AsyncLLM on the replica's slice.

With a TPU slice (accelerator_config), the engine reserves it with `tpuray.SlicePlacementGroup`, one
bundle `{"TPU": 1, "CPU": 1}` per chip, and hands that placement group to vLLM's Ray executor
(`parallel_config.placement_group`, as Ray Serve LLM does with its own), so tensor_parallel_size spans
the slice's chips: one vLLM worker per chip, TPU_VISIBLE_CHIPS set by Ray. On a real slice vLLM's TPU
platform (vllm-tpu / vLLM-TorchTPU) computes; on an EMULATED slice tpuray's vLLM platform plugin
(plugin.py) runs vLLM's CPU backend in those per-chip worker processes, and describe() and the logs
say so. Without an accelerator_config vLLM runs on this machine's CPU with its own executor.

The OpenAI layer on top is vLLM's own (tpuray.serve.llm.vllm_backend).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tpuray.constants import VLLM_PLATFORM_ENV
from tpuray.serve.llm import model_source
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.vllm.args import split_engine_kwargs
from tpuray.serve.llm.engine.vllm.plugin import EMULATED_TPU
from tpuray.validation import ConfigError

logger = logging.getLogger(__name__)

# vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB per worker) or, without it, from
# gpu_memory_utilization x host memory (default 0.92: all of it). Without either, tpuray asks for this.
DEFAULT_CPU_KVCACHE_GIB = "1"


class VLLMEngine:
    """One model's vLLM engine (AsyncLLM), and the slice its workers run on."""

    def __init__(self, config: LLMConfig, *, reservation_timeout_s: float = 120.0) -> None:
        import ray

        self.config = config
        self.spg: Any = None
        self.client: Any = None
        self.emulated = False
        self.engine_args, self.frontend_args = split_engine_kwargs(config)
        try:
            if config.topology is not None:
                self._reserve(reservation_timeout_s)
            path = self._model_path()
            self._start(path, ray.get_runtime_context().gcs_address if ray.is_initialized() else None)
        except BaseException:
            self.shutdown()
            raise

    # -- start ----------------------------------------------------------------------------------------
    def _reserve(self, timeout_s: float) -> None:
        from tpuray.slices import SlicePlacementGroup, list_slices

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
        )
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
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor.abstract import Executor

        cfg = self.config
        if ray_address:  # vLLM's engine core is a Ray driver of its own: it must join this cluster
            os.environ["RAY_ADDRESS"] = ray_address
        if "gpu_memory_utilization" not in self.engine_args and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            if self._cpu_backend():
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KVCACHE_GIB
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
        vllm_config = self.args.create_engine_config()
        if self.spg is not None:
            vllm_config.parallel_config.placement_group = self.spg.placement_group
        self.client = AsyncLLM(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not self.args.disable_log_stats,
            log_requests=self.args.enable_log_requests,
        )
        self.vllm_config = vllm_config
        # an emulated slice is said where operators look (a warning reaches the replica's log by default)
        log = logger.warning if self.emulated else logger.info
        log("%s: vLLM engine up: %s", cfg.model_id, self.where())

    @staticmethod
    def _cpu_backend() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

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
            return f"tensor_parallel_size={tp} on this machine's CPU (vLLM CPU backend)"
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
            "where": self.where(),
        }

    async def check_health(self) -> None:
        await self.client.check_health()

    def shutdown(self) -> None:
        """Stop vLLM (engine core and its workers) and release the slice. Idempotent."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - the slice must be released anyway
                logger.exception("vLLM engine shutdown failed")
        spg, self.spg = self.spg, None
        if spg is not None:
            spg.shutdown()
