"""Model execution: `ModelRunner`, one shard of the model with its KV cache and step programs.

A step is a list of `(slot, new_token_ids, start_position, prompt_logprobs_n)`; prompts (several tokens)
run as packed prefills and one-token sequences as a batched decode, padded to fixed shapes where the
runner compiles (step_plan.py). Every rank runs the same step (the all_reduces pair up); rank 0 returns
a `StepResult`, other ranks None. Imports neither Ray nor the serving layer (a TPU VM runs it alone).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from tpuray.constants import TPU_ACCELERATOR_TYPE_ENV
from tpuray.serve.llm.engine import compile_cache
from tpuray.serve.llm.engine.embedded.kv_cache import KVCache
from tpuray.serve.llm.engine.embedded.logits import token_logprobs
from tpuray.serve.llm.engine.embedded.model import ShardedLlama
from tpuray.serve.llm.engine.embedded.programs import StepPrograms
from tpuray.serve.llm.engine.embedded.step_plan import (
    FROM_DEVICE,
    Buckets,
    DecodeBatch,
    PrefillPack,
    Step,
    decode_batches,
    pack_prefills,
)
from tpuray.serve.llm.generation import TokenLogprobs

PromptLogprobs = dict[int, list[TokenLogprobs]]  # batch index -> logprobs of prompt tokens 1.. (echo)

KVWrite = Literal["auto", "scatter", "dense"]
"""How a decode step stores its K/V (kv_cache.py): "scatter", "dense", or "auto": dense for decode
batches of DENSE_WRITE_MIN_ROWS or more on a real TPU, scatter elsewhere. A decode step of the 1.1B model
on a v5e (benchmarks/README.md): batch 1 3.3 ms with a scatter, 7.1 dense; batches 2-32 10.3-13.7 ms
with scatters, 4.4-4.6 dense."""

DENSE_WRITE_MIN_ROWS = 2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}


@dataclass
class StepResult:
    """What rank 0 hands back for a step: the greedy token of every row (computed on the device, so a
    greedy batch reads back only these ids), the rows' logits [rows, vocab] (float32, CPU) when the
    scheduler asked for them (sampling, penalties, masks, logprobs), and prompt logprobs (echo)."""

    token_ids: list[int]
    logits: torch.Tensor | None = None
    prompt_logprobs: PromptLogprobs = field(default_factory=dict)


@dataclass
class Launched:
    """A step whose programs are launched (on a TPU: queued on the device) and not yet read back:
    `ModelRunner.collect` turns it into the StepResult. `parts`: each pack's / batch's rows with its
    logits and greedy ids, still on the device."""

    batch: Step
    need_logits: bool
    parts: list[tuple[list[int], torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(eq=False, frozen=True)
class StepFunctions:
    """The bodies of the two step programs, on an object of their own: what a compiled program reads (the
    model, the KV cache, `last_ids`), apart from the runner that owns the programs, since a saved program
    records the objects it reads (as shapes and types, no values: programs.py). `last_ids`: each cache
    slot's greedy id of its latest step, on the device (async scheduling reads it: FROM_DEVICE)."""

    model: ShardedLlama
    cache: KVCache
    last_ids: torch.Tensor
    kv_write: KVWrite
    dense_write_min_rows: int

    def prefill(self, packed: torch.Tensor, num_prompts: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, segments, slots, last = PrefillPack.unpack(packed, num_prompts)
        logits = self.model.prefill(tokens, positions, segments, slots, last, self.cache)
        ids = logits.argmax(dim=-1)
        # a real prompt has >= 2 tokens, so its last index is >= 1; padding entries (0) go to the trash
        self.last_ids[torch.where(last > 0, slots[last], self.cache.trash_slot)] = ids
        return logits, ids

    def decode(self, packed: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, slots = packed
        tokens = torch.where(tokens == FROM_DEVICE, self.last_ids[slots], tokens)
        dense = self.kv_write == "dense" and len(tokens) >= self.dense_write_min_rows  # static per bucket
        logits = self.model.decode(tokens, positions, slots, self.cache, context_len, dense_write=dense)
        ids = logits.argmax(dim=-1)
        self.last_ids[slots] = ids
        return logits, ids


def _chip_kind(device: torch.device) -> str:
    """The accelerator a program was compiled for: the host's TPU type and the device's own name."""
    kind = os.environ.get(TPU_ACCELERATOR_TYPE_ENV, "")
    get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    if callable(get_name):
        try:
            kind += f"/{get_name()}"
        except (RuntimeError, AssertionError):  # a backend without device names
            pass
    return kind


def _real_tpu(device: torch.device) -> bool:
    from tpuray.runtime import is_emulated

    return device.type == "tpu" and not is_emulated()


def default_backend(device: torch.device, world_size: int) -> str:
    """The compile backend a compiled runner uses unless told: on a real TPU "tpu-donate" (the KV cache
    updated in place: tpu_compile.py) for one chip, torch_tpu's "tpu" under tensor parallelism (its
    programs have collectives); "inductor" elsewhere."""
    if device.type != "tpu":
        return "inductor"
    return "tpu-donate" if world_size == 1 and _real_tpu(device) else "tpu"


def warmup_prefill(T: int, buckets: Buckets, trash_slot: int) -> PrefillPack:
    """The pack that compiles token bucket T at warm-up: one prompt of T - 1 tokens and one padding token
    (or, where T - 1 tokens would fit a smaller bucket, prompts of T - 1 tokens and of 1).

    Not a prompt that fills the bucket alone (unless a pack holds one prompt: its program may be causal):
    its attention mask would be exactly lower-triangular, and torch_tpu's compiler (its
    `detect_causal_mask` pass, which evaluates the mask on the example inputs) would then replace the
    mask by `is_causal=True` in the program for good, so that the prompts of a packed prefill would
    attend to each other's tokens on a TPU."""
    if T > 1 and Buckets.pick(T - 1, buckets.tokens) == T:
        prompts = [[0] * (T - 1)]
    elif T > 1 and buckets.prefill_seqs != 1:  # T - 1 fits a smaller bucket (T = 2^k + 1): two prompts
        prompts = [[0] * (T - 1), [0]]
    else:  # one prompt per pack: a causal program is right
        prompts = [[0] * T]
    step: Step = [(trash_slot, ids, 0, None) for ids in prompts]
    return pack_prefills(step, list(range(len(step))), buckets, trash_slot)[0]


class ModelRunner:
    """One shard of the model, its KV cache and the step programs.

    `compile` (default: on a real TPU) compiles the prefill and decode programs with torch.compile
    (`dynamic=False`, torch_tpu's "tpu" backend on a TPU, `compile_backend` to choose another) for every
    bucket in `warmup()`, so that serving never compiles again; steps are padded to the buckets
    (step_plan.py). Every program also stores its greedy ids in `last_ids` (one per cache slot, on the
    device), where a decode row whose token is `FROM_DEVICE` takes its input: a step can be launched
    before the previous one is read back (async scheduling: `launch`, then `collect`). Without it steps run eagerly at their exact sizes (`static_shapes=True` pads them
    anyway: the compiled runner's inputs without the compiler; `buckets` replaces the default sizes).
    Where a compiled runner finds its programs saved (programs.py), `load_workers` threads read them at
    warm-up (1: each one at its first call); `async_compile` has torch_tpu lower and compile the missing
    ones in background threads while the next is traced (None: where it applies, the "tpu-donate"
    backend on one chip with the compilation cache on; False: one by one)."""

    def __init__(
        self,
        path: str,
        *,
        max_num_seqs: int,
        max_model_len: int,
        dtype: str = "auto",
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        all_reduce=None,
        compile: bool | None = None,
        compile_backend: str | None = None,
        static_shapes: bool = False,
        buckets: Buckets | None = None,
        kv_write: KVWrite = "auto",
        decode_attention: Literal["auto", "sdpa", "matmul"] = "auto",
        load_workers: int = 1,
        async_compile: bool | None = None,
    ):
        if not isinstance(load_workers, int) or load_workers < 1:
            raise ValueError(f"load_workers={load_workers!r} is not valid; valid: an integer >= 1")
        self.load_workers = load_workers
        """Threads that read saved programs at warm-up (programs.py; 1: each read at its first call)."""
        if kv_write not in ("auto", "scatter", "dense"):
            raise ValueError(f"kv_write={kv_write!r} is not valid; valid: 'auto', 'scatter', 'dense'")
        real_tpu = _real_tpu(torch.device(device))
        if decode_attention == "auto":  # model.DecodeAttention: the matmul form only pays on a TPU
            decode_attention = "matmul" if real_tpu else "sdpa"
        self.model = ShardedLlama(
            path, rank, world_size, DTYPES[dtype], device, all_reduce, decode_attention=decode_attention
        )
        self.rank = rank
        self.device = self.model.device
        self.cache = self.model.new_kv_cache(max_num_seqs, max_model_len)
        last_ids = torch.zeros(self.cache.trash_slot + 1, dtype=torch.long, device=self.device)
        chosen: KVWrite = kv_write if kv_write != "auto" else ("dense" if real_tpu else "scatter")
        min_rows = DENSE_WRITE_MIN_ROWS if kv_write == "auto" else 1
        self.steps = StepFunctions(self.model, self.cache, last_ids, chosen, min_rows)
        self.compiled = real_tpu if compile is None else compile
        given = [f"load_workers={load_workers!r}"] if load_workers != 1 else []
        given += [f"async_compile={async_compile!r}"] if async_compile else []
        if not self.compiled and given:
            raise ValueError(
                f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to a compiled runner; "
                f"this one runs eagerly (compile={compile!r} on {device!r}): leave them unset"
            )
        padded = self.compiled or static_shapes
        if buckets is None:
            buckets = (
                Buckets.for_engine(max_num_seqs, max_model_len, max_model_len) if padded else Buckets.exact()
            )
        self.buckets = buckets
        self.backend: str | None = None  # the torch.compile backend, where compiled
        self.programs: StepPrograms | None = None  # the compiled programs (programs.py), where compiled
        self.warmup_s = 0.0
        self.warmup_phases: dict[str, float] = {}
        """Seconds of the last warm-up's phases: "read" (saved programs read by `load_workers` threads),
        "build" (each program loaded or compiled), "save", "run" (each program's first run)."""
        self._prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.steps.prefill
        self._decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.steps.decode
        if self.compiled:
            if real_tpu:  # XLA programs kept on the host's disk for the next start (compile_cache.py)
                compile_cache.enable()
            self.backend = compile_backend or default_backend(self.device, world_size)
            self._compile(self.backend, path, kv_write, async_compile)

    @property
    def kv_write(self) -> KVWrite:
        """The decode batches' K/V writes: "scatter", or "dense" (for batches of DENSE_WRITE_MIN_ROWS or
        more when chosen by "auto"; every batch when asked for)."""
        return self.steps.kv_write

    @property
    def compilations(self) -> int:
        """Programs built by the compiler (warm-up included); 0 where nothing is compiled."""
        return self.programs.compiled if self.programs else 0

    @property
    def loaded_programs(self) -> int:
        """Programs read whole from the host's compilation cache instead of compiled."""
        return self.programs.loaded if self.programs else 0

    def _compile(self, backend_name: str, path: str, kv_write: str, async_compile: bool | None) -> None:
        from torch._dynamo import config as dynamo_config

        # one Dynamo cache entry per bucket (where Dynamo dispatches): raise its limits (default 8)
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4 * self.buckets.num_programs))
        # a tensor-parallel program names its process group inside the graph: not saved (programs.py)
        key = self._program_key(backend_name, path, kv_write) if self.model.world_size == 1 else None
        self.programs = StepPrograms(self.steps.prefill, self.steps.decode, backend_name, key, async_compile)
        self._prefill, self._decode = self.programs.prefill, self.programs.decode

    def _program_key(self, backend_name: str, path: str, kv_write: str) -> dict:
        """What the step programs depend on besides the weights' values: the code, the model's shape, the
        runner's settings, the chip (compile_cache.ProgramStore adds the versions of Python, torch,
        torch_tpu and libtpu)."""
        model_config = (
            (Path(path) / "config.json").read_text() if (Path(path) / "config.json").exists() else path
        )
        return {
            "code": compile_cache.source_digest(Path(__file__).parent),
            "model_config": model_config,
            "dtype": str(self.model.dtype),
            "backend": backend_name,
            "device": str(self.device),
            "chip": _chip_kind(self.device),
            "rank": self.rank,
            "world_size": self.model.world_size,
            "buckets": self.buckets,
            "kv_write": kv_write,
            "decode_attention": self.model.decode_attention,
            "kv_cache": [len(self.cache.k), list(self.cache.k[0].shape), str(self.cache.k[0].dtype)],
        }

    def warmup(self) -> int:
        """Build every bucket's program, then run each once on padding; returns the programs compiled.
        A no-op without `compile`."""
        if not self.compiled:
            return 0
        start, before, trash = time.perf_counter(), self.compilations, self.cache.trash_slot
        b = self.buckets
        runs: list[tuple[str, tuple]] = [
            ("prefill", self._prefill_args(warmup_prefill(T, b, trash))) for T in b.tokens
        ]
        for B in b.batch:
            d = decode_batches([(trash, [0], 0, None)] * B, list(range(B)), b, trash)[0]
            runs += [("decode", self._decode_args(d, L)) for L in b.context]
        phases, mark = {}, start
        if self.programs is not None:
            programs = self.programs
            if self.load_workers > 1:
                programs.preload([programs.name(kind, args) for kind, args in runs], self.load_workers)
            phases["read"], mark = time.perf_counter() - mark, time.perf_counter()
            programs.build(runs)  # all built before any runs: async_compile overlaps them
            phases["build"], mark = time.perf_counter() - mark, time.perf_counter()
            programs.save_built()
            phases["save"], mark = time.perf_counter() - mark, time.perf_counter()
        for kind, args in runs:
            (self._prefill if kind == "prefill" else self._decode)(*args)[1].cpu()
        phases["run"] = time.perf_counter() - mark
        self.warmup_s, self.warmup_phases = time.perf_counter() - start, phases
        return self.compilations - before

    # -- steps --------------------------------------------------------------------------------------------
    def _prefill_args(self, p: PrefillPack) -> tuple[torch.Tensor, int]:
        """A pack's program inputs: its integers go to the device in one copy (step_plan.py), the same way
        at warm-up and serving, so both share their compiled programs."""
        return p.packed.to(self.device), p.num_prompts

    def _decode_args(self, d: DecodeBatch, context_len: int) -> tuple[torch.Tensor, int]:
        return d.packed.to(self.device), context_len

    def _run_prefill(self, p: PrefillPack) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, greedy ids) of a pack."""
        return self._prefill(*self._prefill_args(p))

    def _run_decode(self, d: DecodeBatch, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode(*self._decode_args(d, context_len))

    def _collect(self, rows, out, greedy, logits, ids) -> None:
        n = len(rows)
        if self.rank != 0:
            return
        for i, token in zip(rows, ids[:n].tolist(), strict=True):
            greedy[i] = token
        if out is not None:
            out[rows] = logits[:n].float().cpu()

    def step(self, batch: Step, need_logits: bool = True) -> StepResult | None:
        """Rank 0: the StepResult of the batch (rows in batch order); other ranks: None. Every rank runs
        the same programs (their all_reduces pair up)."""
        return self.collect(self.launch(batch, need_logits))

    def launch(self, batch: Step, need_logits: bool = True) -> Launched:
        """Start the batch's programs without reading anything back (echo rows run in `collect`). A
        decode row's token may be FROM_DEVICE: the greedy id of its slot's latest launched step."""
        trash, launched = self.cache.trash_slot, Launched(batch, need_logits)
        prefill = [i for i, (_, ids, _, n) in enumerate(batch) if len(ids) > 1 and n is None]
        decode = [i for i, (_, ids, _, _) in enumerate(batch) if len(ids) == 1]
        for p in pack_prefills(batch, prefill, self.buckets, trash):
            launched.parts.append((p.rows, *self._run_prefill(p)))
        for d in decode_batches(batch, decode, self.buckets, trash):
            launched.parts.append((d.rows, *self._run_decode(d, d.context_len)))
        return launched

    def collect(self, launched: Launched) -> StepResult | None:
        """Read a launched step back (rank 0: its StepResult; other ranks: None)."""
        batch, need_logits = launched.batch, launched.need_logits
        echo = [i for i, (_, ids, _, n) in enumerate(batch) if len(ids) > 1 and n is not None]
        greedy = [0] * len(batch)
        out = torch.empty(len(batch), self.model.vocab_size) if need_logits or echo else None
        for rows, logits, ids in launched.parts:
            self._collect(rows, out, greedy, logits, ids)
        prompt_lps = {i: self._echo(batch[i], i, out, greedy) for i in echo}
        if self.rank != 0:
            return None
        if echo and not need_logits:
            out = None
        return StepResult(greedy, out, {i: lp for i, lp in prompt_lps.items() if lp is not None})

    def _echo(self, row, i: int, out, greedy) -> list[TokenLogprobs] | None:
        """A prompt whose every token's logprobs were asked for (echo): one eager pass of its own (the
        compiled programs return only last-token logits)."""
        slot, ids, start, n = row
        p = pack_prefills([row], [0], Buckets.exact(), self.cache.trash_slot)[0]
        inputs = PrefillPack.unpack(p.packed.to(self.device), p.num_prompts)
        logits = self.model.prefill(*inputs, self.cache, all_positions=True)
        if self.rank != 0:
            return None
        full = logits.float().cpu()
        out[i], greedy[i] = full[-1], int(full[-1].argmax())
        return token_logprobs(torch.log_softmax(full[:-1], dim=-1), ids[1:], [n or 0] * (len(ids) - 1))
