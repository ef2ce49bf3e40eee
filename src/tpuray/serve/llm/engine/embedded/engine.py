"""The embedded engine: PyTorch + transformers, tensor parallel over the slice's chips, continuous batching.

Without an accelerator_config the model runs in this process (one CPU "worker"). With a TPU slice the
engine starts a `tpuray.slices.SliceWorkerGroup` of `EngineWorker`s (one per chip share, ranked by slice
position, joined by a `tpu_dist` process group) and drives one step at a time from an asyncio loop.
`shutdown()` stops the workers and releases the slice; `generate` after it raises EngineShutDownError.

A worker that dies (its process killed, its host lost) kills the engine: the tensor-parallel group cannot
step without it. The engine then fails every sequence it holds and every later `generate` at once with
Ray's error of that death (`dead`; no step waits on the dead group), and `check_alive` raises it, so the
serving replica starts a new engine on a fresh slice reservation (deployments/failover.py). `end(error)`
does the same for an engine the replica gives up (its slice reached a preemption deadline).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tpuray.serve.llm import model_source
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.embedded.pipeline import Flight, StepPipeline
from tpuray.serve.llm.engine.embedded.runner import Launched, ModelRunner, StepResult
from tpuray.serve.llm.engine.embedded.scheduler import Scheduler, Sequence
from tpuray.serve.llm.engine.embedded.worker import EngineWorker
from tpuray.serve.llm.generation import PromptEncoder, SamplingParams, SeqOutput
from tpuray.slices import start_group
from tpuray.slices.inventory import holder_name
from tpuray.slices.worker_group import SliceWorkerGroup, WorkerGroupSpec

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


class EngineShutDownError(RuntimeError):
    """A request reached an engine after `shutdown()`."""


class EmbeddedEngine(PromptEncoder):
    worker_cls: type[EngineWorker] = EngineWorker  # the per-chip actor (tpuray.rl: a RolloutWorker)

    def __init__(
        self,
        config: LLMConfig,
        *,
        use_actors: bool | None = None,
        reservation_timeout_s: float = 120.0,
        runner_options: dict[str, Any] | None = None,
    ):
        """`runner_options`: extra ModelRunner arguments of an in-process engine (tests and benchmarks:
        compile, compile_backend, static_shapes)."""
        config.check_model_source()
        self.config = config
        path = Path(model_source.resolve(config.model_source))  # here: the tokenizer and config.json
        self._read_model(path)
        self.scheduler = Scheduler(
            self.tokenizer, _eos_ids(path, self.tokenizer), self.max_num_seqs, self.max_model_len
        )
        self.group: SliceWorkerGroup | None = None
        self.runner: ModelRunner | None = None
        self.closed = False
        self.worker_info: list[dict] = []
        self._loop_task: asyncio.Task | None = None
        self.pipeline: StepPipeline | None = None  # the step loop's (made with it)
        self._step_ids = itertools.count()  # the workers' handles of launched steps
        self._wakeup: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.dead: BaseException | None = None  # a worker's death (Ray's error) or end()'s error; kept
        self.metrics = self._engine_metrics() if config.log_engine_metrics else None
        use_actors = config.topology is not None if use_actors is None else use_actors
        self._start(path, use_actors, reservation_timeout_s, runner_options or {})
        requested = config.engine_kwargs.get("async_scheduling")
        self.async_scheduling: bool = requested is None or bool(requested)
        """engine_kwargs `async_scheduling` (vLLM's name and default: None or True on, False off): launch
        each greedy step before the previous one is read back (pipeline.py); the tokens are the same
        either way (checked on CPU and on a TPU v5e chip: docs/real-tpu.md)."""

    def _read_model(self, path: Path) -> None:
        """The tokenizer and the limits: vocabulary size, max_model_len, max_num_seqs."""
        from transformers import AutoTokenizer

        tokenizer = self.config.model_loading_config.tokenizer_source
        tok_path = model_source.resolve(tokenizer) if tokenizer else str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        model_cfg = json.loads((path / "config.json").read_text())
        self.vocab_size = int(model_cfg.get("vocab_size") or len(self.tokenizer))  # the logits' width
        kwargs = self.config.engine_kwargs
        self.max_model_len = kwargs.get("max_model_len") or model_cfg.get("max_position_embeddings", 2048)
        self.max_num_seqs = kwargs.get("max_num_seqs", 64)

    def _engine_metrics(self) -> Any:
        """The engine's metrics under vLLM's names (metrics.py), bound to the scheduler's queues."""
        from tpuray.serve.llm.metrics import EngineMetrics

        sched = self.scheduler
        metrics = EngineMetrics(self.config.model_id)
        metrics.bind(
            lambda: len(sched.running),
            lambda: len(sched.waiting),
            lambda: 1.0 - len(sched.free_slots) / self.max_num_seqs,
        )
        return metrics

    def _start(self, path: Path, use_actors: bool, timeout_s: float, runner_options: dict[str, Any]) -> None:
        """The model on its workers (one Ray actor per chip share), or in this process."""
        kwargs = dict(
            self.config.engine_kwargs, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs
        )
        if use_actors:
            try:
                self._start_workers(self.config.model_source, kwargs, timeout_s)
            except BaseException:
                self.shutdown()
                raise
            return
        self.runner = ModelRunner(
            str(path),
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            dtype=kwargs.get("dtype", "auto"),
            **runner_options,
        )
        self.runner.warmup()  # a no-op unless it compiles (a real TPU)

    # -- workers ------------------------------------------------------------------------------------------
    def _start_workers(self, source: str, kwargs: dict, timeout_s: float) -> None:
        import ray

        cfg = self.config
        spec = WorkerGroupSpec(
            num_workers=cfg.num_workers,
            topology=cfg.topology,
            chips_per_worker=cfg.chips_per_worker,
            num_cpus=1,
            reserve_timeout_s=timeout_s,
            runtime_env=cfg.runtime_env,
            name=holder_name("serve", cfg.model_id),
        )
        # Without a slice: one CPU worker actor (benchmarks: the same Ray step path as the TP engine).
        # The start is abandoned as soon as a host of the reserved slice drains or dies (a preemption).
        self.group = SliceWorkerGroup(spec, self.worker_cls)
        lost = start_group(self.group, poll_s=0.2)
        if lost is not None:
            self.group = None
            raise RuntimeError(f"the engine's slice was lost while its workers started: {lost}")
        backend = "tpu_dist" if cfg.topology is not None else ("gloo" if spec.num_workers > 1 else None)
        ray.get(self.group.init_process_group(backend, timeout_s))
        # every host reads the model from its own disk (a Hub id or URL is downloaded once per host)
        path = model_source.resolve_on_hosts(source, self.group.host_strategies(), cfg.runtime_env)
        self.worker_info = ray.get(self.group.call("load", path, kwargs))
        logger.info(
            "%s: embedded engine, tensor_parallel_size=%d on %r; workers %s",
            cfg.model_id,
            self.group.world_size,
            self.group,
            self.worker_info,
        )

    def slice_nodes(self) -> list[str]:
        """The nodes of the engine's slice (none for an in-process engine)."""
        return self.group.node_ids() if self.group is not None else []

    def describe(self) -> dict[str, Any]:
        emulated = any(w.get("emulated") for w in self.worker_info)
        return {
            "engine": "embedded",
            "model": self.config.model_id,
            "tensor_parallel_size": self.group.world_size if self.group else 1,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "workers": self.worker_info,
            "slice": repr(self.group) if self.group else None,
            "emulated": emulated,
            "async_scheduling": self.async_scheduling,
        }

    def _closed_error(self) -> EngineShutDownError:
        return EngineShutDownError(f"the engine of model {self.config.model_id!r} is shut down")

    async def _launch(self, flight: Flight) -> Launched | int | None:
        """Start a step's programs: the in-process runner's handle, or the step's id (workers keep
        their handles by id). Synchronously (no async scheduling) nothing: `_collect` runs the step in
        one call, as before async scheduling existed."""
        if not self.async_scheduling:
            return None
        if self.runner is not None:
            return await asyncio.to_thread(self.runner.launch, flight.batch, flight.need_logits)
        if self.group is None:
            raise self._closed_error()
        step_id = next(self._step_ids)
        await asyncio.gather(*self.group.call("launch", step_id, flight.batch, flight.need_logits))
        return step_id

    async def _collect(self, flight: Flight) -> StepResult:
        """A launched step's StepResult (or a step's, launched here): from the in-process runner, or
        rank 0 of the group."""
        batch, need_logits, handle = flight.batch, flight.need_logits, flight.handle
        if self.runner is not None:
            if handle is None:
                result = await asyncio.to_thread(self.runner.step, batch, need_logits)
            else:
                result = await asyncio.to_thread(self.runner.collect, handle)
        elif self.group is not None:
            call = ("step", batch, need_logits) if handle is None else ("collect", handle)
            result = (await asyncio.gather(*self.group.call(*call)))[0]
        else:
            raise self._closed_error()
        assert result is not None  # rank 0 returns the logits
        return result

    # -- loop ---------------------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Each turn launches the next step (with async scheduling: ahead of reading back the one in
        flight) and reads back and processes the step that must be (pipeline.py)."""
        sched, wakeup = self.scheduler, self._wakeup
        assert wakeup is not None  # made by _ensure_loop, with this task
        pipe = self.pipeline = StepPipeline(sched, ahead=self.async_scheduling)
        while True:
            if not pipe.in_flight and not sched.has_work():
                wakeup.clear()
                await wakeup.wait()
                continue
            flight = pipe.next_step()
            if flight is not None:
                try:
                    pipe.launched(flight, await self._launch(flight))
                except Exception as e:  # a failed step fails its sequences, the engine keeps serving others
                    if self._step_failed(flight, e):
                        return
                    flight = None
            done = pipe.to_collect(flight is not None)
            if done is not None:
                try:
                    result = await self._collect(done)
                except Exception as e:
                    if self._step_failed(done, e):
                        return
                    continue
                pipe.process(done, result)
            elif flight is None:
                await asyncio.sleep(0.001)

    def _step_failed(self, flight: Flight, error: Exception) -> bool:
        """Fail a step's sequences; True when the engine is dead (a worker died)."""
        if self._died(error):
            return True
        logger.exception("engine step failed")
        self.error = error
        for seq in flight.seqs:
            if not seq.finished:
                self.scheduler.abort(seq)
                seq.queue.put_nowait(error)
        return False

    def _died(self, error: BaseException) -> bool:
        """When `error` is a worker's death: mark the engine dead and fail every sequence it holds."""
        import ray

        if not isinstance(error, ray.exceptions.RayActorError):
            return False
        if self.dead is None:
            logger.error(
                "model %s: an engine worker died, the engine is dead: %s", self.config.model_id, error
            )
            self.dead = error
        self._fail_all()
        return True

    def end(self, error: BaseException) -> None:
        """Fail the sequences in flight, and every later request, with `error`, and stop the step loop
        (on the engine's event loop, before `shutdown`: a shut-down loop leaves its sequences waiting).
        The replica's failover ends an engine whose slice reached its preemption deadline this way."""
        if self.dead is None:
            self.dead = error
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        self._fail_all()

    def _fail_all(self) -> None:
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            sched.abort(seq)
            seq.queue.put_nowait(self.dead)

    async def check_alive(self) -> None:
        """Raise Ray's error when a worker is dead (each worker answers a no-op call, queued behind the
        step it runs, if any)."""
        if self.dead is None and self.group is not None:
            try:
                await asyncio.gather(*(actor.__ray_ready__.remote() for actor in self.group.actors))
            except Exception as e:  # noqa: BLE001 - only a death counts; others are re-raised
                if not self._died(e):
                    raise
        if self.dead is not None:
            raise self.dead.with_traceback(None)  # one error for many requests: no growing traceback

    # -- public API ---------------------------------------------------------------------------------------
    def grammar(self, schema: dict | None) -> Any:
        """The compiled grammar of a JSON schema (None: any JSON object) for SamplingParams.grammar;
        grammar.GrammarError when it cannot compile."""
        if self.scheduler.grammars is None:
            from tpuray.serve.llm.engine.embedded.grammar import Grammars

            self.scheduler.grammars = Grammars(self.tokenizer, self.vocab_size, self.scheduler.eos_ids)
        return self.scheduler.grammars.compile(schema)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, index: int = 0
    ) -> AsyncIterator[SeqOutput]:
        """Stream the outputs of one sequence; closing the iterator aborts it."""
        if self.closed:
            raise EngineShutDownError(f"the engine of model {self.config.model_id!r} is shut down")
        if self.dead is not None:
            raise self.dead.with_traceback(None)  # one error for many requests: no growing traceback
        self._ensure_loop()
        seq = Sequence(list(prompt_ids), params, params.generator(index), asyncio.Queue())
        self.scheduler.add(seq)
        if self._wakeup is not None:
            self._wakeup.set()
        m, start = self.metrics, time.perf_counter()
        last, reason = start, None
        if m is not None:
            m.prompt.inc(len(prompt_ids))
        try:
            while True:
                out = await seq.queue.get()
                if isinstance(out, BaseException):
                    raise out
                if m is not None and out.token_ids:
                    t = time.perf_counter()
                    (m.ttft if last == start else m.itl).observe(t - last)
                    m.generation.inc(len(out.token_ids))
                    last = t
                reason = out.finish_reason
                yield out
                if out.finished:
                    return
        finally:
            self.scheduler.abort(seq)
            if m is not None:
                m.finished(reason, time.perf_counter() - start)

    def shutdown(self) -> None:
        """Stop the step loop, the workers and the slice reservation. Idempotent."""
        self.closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        group, self.group = self.group, None
        if group is not None:  # live ranks of a dead group may be stuck in a collective: no teardown wait
            group.shutdown(graceful=self.dead is None)
        self.runner = None
