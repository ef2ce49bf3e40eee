"""The embedded engine: PyTorch + transformers, tensor parallel over the slice's chips, continuous batching.

Without an accelerator_config the model runs in this process (one CPU "worker"). With a TPU slice the
engine reserves one `SlicePlacementGroup`, starts one `EngineWorker` actor per chip share on it (rank
order = slice rank from tpuray.isolation), forms a `tpu_dist` process group across them and drives one
step at a time from an asyncio loop. `shutdown()` kills the workers and releases the slice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.prompts import PromptEncoder
from tpuray.serve.llm.engine.sampling import SamplingParams
from tpuray.serve.llm.engine.scheduler import Scheduler, SeqOutput, Sequence
from tpuray.serve.llm.engine.worker import EngineWorker, ModelRunner

logger = logging.getLogger(__name__)


def _eos_ids(path: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class EmbeddedEngine(PromptEncoder):
    def __init__(
        self, config: LLMConfig, *, use_actors: bool | None = None, reservation_timeout_s: float = 120.0
    ):
        from transformers import AutoTokenizer

        config.check_model_source()
        self.config = config
        path = Path(config.model_loading_config.local_path).expanduser()
        tok_path = config.model_loading_config.tokenizer_source or str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        model_cfg = json.loads((path / "config.json").read_text())
        self.max_model_len = config.engine_kwargs.get("max_model_len") or model_cfg.get(
            "max_position_embeddings", 2048
        )
        self.max_num_seqs = config.engine_kwargs.get("max_num_seqs", 64)
        kwargs = dict(config.engine_kwargs, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs)
        self.scheduler = Scheduler(
            self.tokenizer, _eos_ids(path, self.tokenizer), self.max_num_seqs, self.max_model_len
        )
        self.spg = None
        self.workers: list[Any] = []
        self.runner: ModelRunner | None = None
        self.worker_info: list[dict] = []
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self.error: BaseException | None = None
        use_actors = config.topology is not None if use_actors is None else use_actors
        if use_actors:
            try:
                self._start_workers(str(path), kwargs, reservation_timeout_s)
            except BaseException:
                self.shutdown()
                raise
        else:
            self.runner = ModelRunner(
                str(path),
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len,
                dtype=kwargs.get("dtype", "auto"),
            )

    # -- workers ------------------------------------------------------------------------------------------
    def _start_workers(self, path: str, kwargs: dict, timeout_s: float) -> None:
        import ray

        cfg = self.config
        actor_cls = ray.remote(EngineWorker)
        chips = cfg.chips_per_worker
        if cfg.topology is not None:
            from tpuray.slices import SlicePlacementGroup

            topo = cfg.topology
            self.spg = SlicePlacementGroup(
                topology=topo.topology,
                accelerator_version=topo.generation.name,
                resources_per_bundle={"TPU": chips, "CPU": 1},
                timeout_s=timeout_s,
            )
            per_host = topo.chips_per_host // chips
            strategies = [
                self.spg.scheduling_strategy(self.spg.bundle_index(0, host, share))
                for host in range(topo.num_hosts)
                for share in range(per_host)
            ]
            opts = [dict(num_cpus=1, resources={"TPU": chips}, scheduling_strategy=s) for s in strategies]
        else:  # one worker actor without a slice (benchmarks: same Ray step path as the TP engine)
            opts = [dict(num_cpus=1)]
        self.workers = [actor_cls.options(**o, runtime_env=cfg.runtime_env).remote() for o in opts]
        infos = ray.get([w.describe.remote() for w in self.workers])
        order = sorted(range(len(infos)), key=lambda i: infos[i].get("rank", i))
        self.workers = [self.workers[i] for i in order]
        infos = [infos[i] for i in order]
        world = len(self.workers)
        master = None
        if world > 1:
            master = (infos[0]["node_ip"], ray.get(self.workers[0].free_port.remote()))
        setups = []
        for rank, (w, info) in enumerate(zip(self.workers, infos, strict=True)):
            env = dict(info.get("env", {}))
            if "local_rank" in info:
                env["LOCAL_RANK"] = str(info["local_rank"])
            setups.append(w.setup.remote(path, rank, world, master, env, kwargs))
        self.worker_info = ray.get(setups)
        emulated = any(w.get("emulated") for w in self.worker_info)
        logger.info(
            "%s: embedded engine, tensor_parallel_size=%d on %s%s; workers %s",
            cfg.model_id,
            world,
            repr(self.spg) if self.spg else "one worker",
            " (EMULATED TPU chips on CPU)" if emulated else "",
            self.worker_info,
        )

    def describe(self) -> dict[str, Any]:
        emulated = any(w.get("emulated") for w in self.worker_info)
        return {
            "engine": "embedded",
            "model": self.config.model_id,
            "tensor_parallel_size": max(1, len(self.workers)),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "workers": self.worker_info,
            "slice": repr(self.spg) if self.spg else None,
            "emulated": emulated,
        }

    async def _step(self, batch) -> torch.Tensor:
        if self.runner is not None:
            return await asyncio.to_thread(self.runner.step, batch)
        results = await asyncio.gather(*[w.step.remote(batch) for w in self.workers])
        return results[0]

    # -- loop ---------------------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        sched = self.scheduler
        while True:
            if not sched.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            seqs, batch = sched.schedule()
            if not seqs:
                await asyncio.sleep(0.001)
                continue
            try:
                logits = await self._step(batch)
            except Exception as e:  # a failed step fails its sequences, the engine keeps serving others
                logger.exception("engine step failed")
                self.error = e
                for seq in seqs:
                    sched.abort(seq)
                    seq.queue.put_nowait(e)
                continue
            sched.process(seqs, logits)

    # -- public API ---------------------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, index: int = 0
    ) -> AsyncIterator[SeqOutput]:
        """Stream the outputs of one sequence; closing the iterator aborts it."""
        if self.error is not None and not self.workers and self.runner is None:
            raise RuntimeError("engine is shut down")
        self._ensure_loop()
        seq = Sequence(list(prompt_ids), params, params.generator(index), asyncio.Queue())
        self.scheduler.add(seq)
        self._wakeup.set()
        try:
            while True:
                out = await seq.queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            self.scheduler.abort(seq)

    def shutdown(self) -> None:
        import ray

        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                ray.kill(w)
            except Exception:
                logger.exception("failed to kill engine worker")
        if self.spg is not None:
            self.spg.shutdown()
            self.spg = None
        self.runner = None
