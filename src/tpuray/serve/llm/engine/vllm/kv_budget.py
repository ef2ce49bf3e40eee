"""vLLM's KV cache sized alike at every start of the same engine on a host, so that a second start loads the
compiled model from vLLM's cache instead of compiling it again.

    Nothing to set: where vLLM compiles the model on a TPU (not enforce_eager), with the compilation cache
    on (TPURAY_COMPILE_CACHE, compile_cache.py), tpuray's VLLMEngine does it. engine_kwargs
    kv_cache_memory_bytes or num_gpu_blocks_override size the KV cache instead (tpuray then leaves it
    alone); TPURAY_COMPILE_CACHE=off turns it off.

Why: vLLM sizes its KV cache from the device memory it measures at every start, and vLLM-TorchTPU's
compiler hash (`compute_tpu_compilation_hash`: its programs hold the KV cache's extent) has the block
count among its factors, so the directory of vLLM's compiled model (`torch_compile_cache/<hash>`) and
its AOT key change with it. The measurement moves by a few blocks between starts (405,120 then 405,888
tokens for a 1B model on a v5e): every start compiled the model again (8 token buckets, ~12 s each).

How: the executor vLLM chose runs as `RecordedKVBudget`, which measures as before and gives vLLM as the
KV cache's memory
- the budget an earlier start of the same engine recorded, where it lies within BAND of what was measured
  now and not above it (never more than measured: vLLM's gpu_memory_utilization holds);
- else what was measured less MARGIN, recorded for the next start (a first start, or memory that moved).
The record is a JSON file per engine key (`record_key`) under <TPURAY_COMPILE_CACHE>/vllm-kv/, written by
vLLM's engine core (a child process or this one). One that cannot be read or belongs to another key is
ignored (logged) and replaced; one that cannot be written leaves the next start to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import types
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm.v1.executor.abstract import Executor

from tpuray.serve.llm.engine import compile_cache

logger = logging.getLogger(__name__)

MARGIN = 0.01  # a new budget: what was measured less 1% (measurements moved by 0.25% between starts)
BAND = 2 * MARGIN  # a recorded budget is used while it is at least (1 - BAND) x the memory measured now
RECORD_DIR = "vllm-kv"
USER_SIZED = ("kv_cache_memory_bytes", "num_gpu_blocks_override")  # engine_kwargs that size the KV cache
_GIB = 1 << 30


def choose_budget(measured: int, recorded: int | None) -> int:
    """The KV cache's memory from the memory measured now and an earlier start's budget (None: none)."""
    if recorded is not None and int(measured * (1 - BAND)) <= recorded <= measured:
        return recorded
    return int(measured * (1 - MARGIN))


def sized_by_user(engine_args: Mapping[str, Any]) -> str | None:
    """The engine_kwargs key that sizes the KV cache itself (tpuray then records nothing), or None."""
    return next((k for k in USER_SIZED if engine_args.get(k) is not None), None)


def record_key(vllm_config: Any) -> dict[str, Any]:
    """What the memory measured depends on besides the device: vLLM's config hash (the model and every
    setting that shapes its programs), the memory fraction vLLM may use, and the versions."""
    import vllm
    from vllm.platforms import current_platform

    found = compile_cache.versions()
    for dist in ("vllm_torchtpu", "vllm_torchtpu_core"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {
        "vllm_config_hash": vllm_config.compute_hash(),
        "model": str(vllm_config.model_config.model),
        "gpu_memory_utilization": vllm_config.cache_config.gpu_memory_utilization,
        "world_size": vllm_config.parallel_config.world_size,
        "platform": type(current_platform).__name__,
        "versions": {**found, "vllm": vllm.__version__},
    }


class BudgetRecord:
    """One engine key's recorded KV cache budget: a JSON file under <cache>/vllm-kv/."""

    def __init__(self, path: Path, key: Mapping[str, Any]) -> None:
        self.path = path
        self.key = dict(key)

    @classmethod
    def for_config(cls, vllm_config: Any) -> BudgetRecord | None:
        """The record of this engine's key; None when the compilation cache is off."""
        root = compile_cache.cache_dir()
        if root is None:
            return None
        key = record_key(vllm_config)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return cls(root / RECORD_DIR / f"{digest}.json", key)

    def read(self) -> int | None:
        """The recorded budget in bytes; None when there is none usable (a bad one is logged)."""
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
            budget = data["kv_cache_bytes"]
            if data["key"] != json.loads(json.dumps(self.key, default=str)):
                raise ValueError("it belongs to another engine key")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
                raise ValueError(f"kv_cache_bytes={budget!r} is not a positive integer")
            return budget
        except Exception as e:  # noqa: BLE001 - a bad record is measured again, never a failure
            logger.warning("vLLM KV cache record %s ignored (%s: %s)", self.path, type(e).__name__, e)
            return None

    def write(self, budget: int, measured: list[int]) -> None:
        text = json.dumps(
            {"kv_cache_bytes": budget, "measured_bytes": measured, "key": self.key},
            sort_keys=True,
            default=str,
            indent=1,
        )
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("vLLM KV cache record %s not written (%s); the next start measures again", tmp, e)


def budget_for(vllm_config: Any, measured: list[int]) -> list[int]:
    """The memory each worker gives its KV cache: one budget for all (`choose_budget` from the least
    measured), recorded where it is new; `measured` unchanged where the compilation cache is off."""
    record = BudgetRecord.for_config(vllm_config)
    if record is None or not measured:
        return measured
    least = min(measured)
    recorded = record.read()
    budget = choose_budget(least, recorded)
    if budget == recorded:
        logger.info(
            "vLLM KV cache: %.3f GiB, recorded by an earlier start (%.3f GiB measured now): sized alike, "
            "its compiled model loads from vLLM's cache",
            budget / _GIB,
            least / _GIB,
        )
    else:
        record.write(budget, measured)
        moved = "" if recorded is None else f" (the recorded {recorded / _GIB:.3f} GiB no longer fits)"
        logger.info(
            "vLLM KV cache: %.3f GiB, %.3f GiB measured less %d%%%s; recorded in %s so that later starts "
            "size it alike and load the compiled model",
            budget / _GIB,
            least / _GIB,
            round(MARGIN * 100),
            moved,
            record.path,
        )
    return [budget] * len(measured)


class RecordedKVBudget(Executor):
    """The executor vLLM chose for this config (`Executor.get_class`), with its KV cache's memory from
    `budget_for`. Pass this class as vLLM's executor_class: built, it is an instance of a subclass of
    both (`_with_budget`). Module-level, so that it crosses into vLLM's engine-core process by name."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> RecordedKVBudget:
        if cls is not RecordedKVBudget:
            return super().__new__(cls)
        return super().__new__(_with_budget(Executor.get_class(vllm_config)))

    def determine_available_memory(self) -> list[int]:
        return budget_for(self.vllm_config, super().determine_available_memory())


def _with_budget(base: type[Executor]) -> type[RecordedKVBudget]:
    if issubclass(base, RecordedKVBudget):
        raise TypeError(f"{base.__name__} already records its KV cache budget")
    return types.new_class(
        f"{base.__name__}WithRecordedKVBudget",
        (RecordedKVBudget, base),
        exec_body=lambda ns: ns.update(__module__=__name__),
    )
