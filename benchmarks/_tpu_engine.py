"""The embedded engine's measurements for bench_real_tpu.py (`engine`): a Llama-shaped checkpoint with
random weights, decode rates and where a decode step's time goes, the scheduler's loop over mixed
requests; each loop runs synchronously or with async scheduling (`ahead`: step k+1 launched before step
k is read back, its tokens taken on the device: the engine's pipeline.py). Returns figures; the script
reports them."""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import time
from pathlib import Path

import torch

from tpuray.serve.llm.engine.embedded.step_plan import FROM_DEVICE


def sync() -> None:
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


def live_bytes(device: str):
    """A reader of the device allocator's live bytes (torch's count, on a TPU; 0 elsewhere)."""
    return (lambda: torch.accelerator.memory_allocated()) if device == "tpu" else (lambda: 0)


def synced(fn) -> tuple[float, object]:
    """(seconds of one call of `fn`, the device awaited before and after it; its result)."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def first_and_median(fn, steps: int, first_context=contextlib.nullcontext) -> tuple[float, float, object]:
    """(seconds of the first call, run inside `first_context()`, compiling where it must; the median ms
    of `steps` calls after it; the first call's result), the device awaited around each call."""
    with first_context():
        first, out = synced(fn)
    times = [synced(fn)[0] for _ in range(steps)]
    return first, statistics.median(times) * 1e3, out


def timed(fn, iters: int) -> float:
    """Seconds per call of `fn` over `iters` calls (after one untimed), the device awaited."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def write_llama(
    path: Path, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int
) -> int:
    """A Llama-shaped checkpoint with random bf16 weights (speed only); returns its weight bytes."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    d = hidden // heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "lm_head.weight": w(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": w(heads * d, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * d),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    save_file(state, str(path / "model.safetensors"))
    # the bytes a decode step reads: every weight except the embedding table (rows are gathered)
    return sum(t.numel() * 2 for k, t in state.items() if k != "model.embed_tokens.weight")


def decode_rate(runner, batch: int, steps: int, prompt_len: int = 32, ahead: bool = False) -> float:
    """Tokens/s of `steps` decode steps of `batch` sequences (after their prefill), each step read back
    before the next is launched, or (`ahead`) launched before the previous one is read back, its tokens
    taken from that step's ids on the device."""
    step = [(s, list(range(3, 3 + prompt_len)), 0, None) for s in range(batch)]
    runner.step(step, need_logits=False)
    pos = prompt_len
    runner.step([(s, [7], pos, None) for s in range(batch)], need_logits=False)  # one untimed
    start, pending = time.perf_counter(), None
    for i in range(steps):
        if not ahead:
            runner.step([(s, [7 + i % 50], pos + 1 + i, None) for s in range(batch)], need_logits=False)
            continue
        launched = runner.launch([(s, [FROM_DEVICE], pos + 1 + i, None) for s in range(batch)], False)
        if pending is not None:
            runner.collect(pending)
        pending = launched
    if pending is not None:
        runner.collect(pending)
    return batch * steps / (time.perf_counter() - start)


def decode_split(runner, batch: int, steps: int, pos: int = 40) -> dict:
    """Where a decode step's time goes (ms per step): the whole `runner.step`; the program alone with its
    inputs already on the device and its ids read back each step; the program alone without reading back
    (steps queue up: the device's own time per step once the host keeps ahead); one small host-to-device
    copy (a step makes three)."""
    from tpuray.serve.llm.engine.embedded.step_plan import decode_batches

    rows = [(s, [7], pos, None) for s in range(batch)]
    d = decode_batches(rows, list(range(batch)), runner.buckets, runner.cache.trash_slot)[0]
    dev = runner.device
    args = (d.packed.to(dev), d.context_len)
    runner._decode(*args)[1].cpu()

    def per_step(fn) -> float:
        return timed(fn, steps) * 1e3

    def dispatch_only() -> float:  # the host's time to launch the program, device not awaited
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            runner._decode(*args)
        took = (time.perf_counter() - t) / steps * 1e3
        sync()
        return took

    small = torch.arange(batch, dtype=torch.long)
    packed = torch.arange(3 * batch, dtype=torch.long)
    return dict(
        batch=batch,
        step_ms=per_step(lambda: runner.step(rows, need_logits=False)),
        program_readback_ms=per_step(lambda: runner._decode(*args)[1].cpu()),
        program_pipelined_ms=per_step(lambda: runner._decode(*args)),
        program_dispatch_ms=dispatch_only(),
        host_to_device_ms=per_step(lambda: small.to(dev)),
        host_to_device_x3_ms=per_step(lambda: [t.to(dev) for t in (small, small, small)]),
        host_to_device_packed_ms=per_step(lambda: packed.to(dev)),
    )


class NumberTokenizer:
    """Detokenizes ids as numbers: the bench's random-weight model has no tokenizer of its own."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)


def _scheduler(max_num_seqs: int, max_model_len: int):
    from tpuray.serve.llm.engine.embedded.scheduler import Scheduler

    return Scheduler(NumberTokenizer(), {2}, max_num_seqs, max_model_len, max_prefill_tokens=max_model_len)


def _add(sched, prompt: list[int], params) -> None:
    import asyncio

    from tpuray.serve.llm.engine.embedded.scheduler import Sequence

    sched.add(Sequence(prompt, params, params.generator(), asyncio.Queue()))


def _drain(runner, sched, ahead: bool) -> int:
    """Run the scheduler's loop (the engine's StepPipeline) until every request is done; its steps."""
    from tpuray.serve.llm.engine.embedded.pipeline import StepPipeline

    pipe, launched = StepPipeline(sched, ahead), 0
    launch = runner.launch

    def counted(batch, need_logits):
        nonlocal launched
        launched += 1
        return launch(batch, need_logits)

    while pipe.turn(counted, runner.collect):
        pass
    return launched


def serve_mixed(
    runner, n_requests: int, max_num_seqs: int, max_model_len: int, seed: int = 0, ahead: bool = False
) -> dict:
    """The engine's own loop (Scheduler: continuous batching) over requests of mixed prompt and output
    lengths, greedy and sampled; counts the programs compiled while serving."""
    from tpuray.serve.llm.generation import SamplingParams

    rng = random.Random(seed)
    sched = _scheduler(max_num_seqs, max_model_len)
    tokens = 0
    for i in range(n_requests):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, min(512, max_model_len - 64)))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 64), temperature=0.0 if i % 4 else 0.8, seed=i, ignore_eos=True
        )
        tokens += params.max_tokens
        _add(sched, prompt, params)
    before, start = runner.compilations, time.perf_counter()
    steps = _drain(runner, sched, ahead)
    return dict(
        requests=n_requests,
        async_scheduling=ahead,
        steps=steps,
        tokens=tokens,
        seconds=time.perf_counter() - start,
        compilations_while_serving=runner.compilations - before,
    )


def loop_rate(runner, steps: int, ahead: bool, max_num_seqs: int, max_model_len: int) -> float:
    """Tokens/s of one greedy request of `steps` tokens through the scheduler's loop (what a batch-1
    client of the engine sees, without HTTP): sampling, stop checks and detokenizing included."""
    from tpuray.serve.llm.generation import SamplingParams

    sched = _scheduler(max_num_seqs, max_model_len)
    _add(sched, list(range(3, 35)), SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    _drain(runner, sched, ahead)
    return steps / (time.perf_counter() - start)


PROMPT = list(range(3, 40))  # the greedy checks' prompt
MODES = ("sync", "waited", "ahead")


def greedy_tokens(runner, n: int = 24, mode: str = "sync", slot: int = 0) -> list[int]:
    """`n` greedy tokens of one sequence (cache slot `slot`) from a fixed prompt: compares backends' and
    modes' outputs. `mode`: "sync" (each step's ids read back, then the next step launched), "waited" (the
    next step takes its token from the device, FROM_DEVICE, after the previous step finished), "ahead"
    (async scheduling: launched before the previous step is read back)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not valid; valid: {', '.join(MODES)}")
    pending, ids = runner.launch([(slot, PROMPT, 0, None)], need_logits=False), []
    for i in range(n - 1):
        pos = len(PROMPT) + i
        if mode == "sync":
            ids.append(runner.collect(pending).token_ids[0])
            launched = runner.launch([(slot, [ids[-1]], pos, None)], need_logits=False)
        else:
            if mode == "waited":
                pending.parts[0][2].cpu()  # the previous step's ids: it has finished
            launched = runner.launch([(slot, [FROM_DEVICE], pos, None)], need_logits=False)
            ids.append(runner.collect(pending).token_ids[0])
        pending = launched
    ids.append(runner.collect(pending).token_ids[0])
    return ids


class _Unwritten:
    """A KV cache whose writes are dropped (reads and sizes are the runner's cache's): a prefill program
    over it measures the model's time without its cache writes."""

    def __init__(self, cache) -> None:
        self.__dict__.update(cache.__dict__)

    def write(self, layer, slots, positions, k, v) -> None:
        pass


def prefill_split(runner, prompt_len: int, steps: int) -> dict:
    """Where a prompt's time to first token goes (ms, median of `steps`): the whole `runner.step` (TTFT:
    packing on the host, one input copy, the program, the ids read back); the prefill program alone with
    its inputs already on the device; the same program compiled over a cache whose writes are dropped
    (what the prompt's K/V scatters into the cache cost, as the difference)."""
    from tpuray.serve.llm.engine.embedded.runner import StepFunctions
    from tpuray.serve.llm.engine.embedded.step_plan import pack_prefills
    from tpuray.serve.llm.engine.embedded.tpu_compile import lookup

    prompt = list(range(3, 3 + prompt_len))
    row = [(0, prompt, 0, None)]
    pack = pack_prefills(row, [0], runner.buckets, runner.cache.trash_slot)[0]
    packed = pack.packed.to(runner.device)
    s = runner.steps
    unwritten = StepFunctions(s.model, _Unwritten(s.cache), s.last_ids, s.kv_write, s.dense_write_min_rows)
    backend = lookup(runner.backend) if runner.backend else "eager"
    no_writes = torch.compile(unwritten.prefill, backend=backend, dynamic=False, fullgraph=True)

    def median_ms(fn) -> float:
        return first_and_median(fn, steps)[1]  # the first call untimed: it compiles where it must

    return dict(
        prompt_tokens=prompt_len,
        pack_tokens=int(packed.shape[-1]),
        step_ms=median_ms(lambda: runner.step(row, need_logits=False)),
        program_ms=median_ms(lambda: runner._prefill(packed, pack.num_prompts)[1].cpu()),
        program_without_cache_writes_ms=median_ms(lambda: no_writes(packed, pack.num_prompts)[1].cpu()),
    )


def bench_prefill(args, report, checkpoint) -> None:
    """Where a prompt's time to first token goes (`prefill_split`), for prompts of --prompt-lens tokens,
    and a decode step's (`decode_split`) for --decode-batches rows at --decode-positions (each row's
    position: its context bucket): what each bucket costs, to weigh a bucket's compile at start against
    the padding without it. The engine compiles only the shapes measured (no warm-up)."""
    from tpuray.serve.llm.engine.embedded.runner import ModelRunner

    path, _ = checkpoint(args)
    runner = ModelRunner(
        str(path),
        max_num_seqs=32,
        max_model_len=args.max_model_len,
        dtype="bfloat16",
        device=args.device,
        compile=True if args.device == "tpu" else None,
        compile_backend=args.compile_backend.split(",")[0] if args.device == "tpu" else None,
    )
    for prompt_len in args.prompt_lens:
        report("prefill_split", backend=runner.backend, **prefill_split(runner, prompt_len, args.steps))
    for pos in args.decode_positions:
        for batch in args.decode_batches:
            report(
                "decode_split",
                backend=runner.backend,
                pos=pos,
                **decode_split(runner, batch, args.steps, pos),
            )


def bench_kv_write(args, report) -> None:
    """What writing one token per sequence into a KV cache costs on the device (ms): an eager indexed
    write into a stacked [layers, slots + 1, len, kv_heads, head_dim] cache (in place if torch_tpu
    updates the buffer where it lies; a whole-cache copy otherwise), against copying the whole cache."""
    dev = torch.device(args.device)
    layers, slots, length, kv, d = 16, 33, args.max_model_len, 8, 64
    cache = torch.zeros(layers, slots, length, kv, d, dtype=torch.bfloat16, device=dev)
    other = torch.zeros_like(cache)
    for batch in (1, 32):
        idx = torch.arange(batch, device=dev)
        pos = torch.full((batch,), 7, device=dev)
        new = torch.ones(layers, batch, kv, d, dtype=torch.bfloat16, device=dev)
        lidx = torch.arange(layers, device=dev)[:, None]

        def write(lidx=lidx, idx=idx, pos=pos, new=new):
            cache.index_put_((lidx, idx[None], pos[None]), new)

        report(
            "kv_write",
            batch=batch,
            cache_bytes=cache.numel() * 2,
            indexed_write_ms=timed(write, args.steps) * 1e3,
            full_copy_ms=timed(lambda: other.copy_(cache), args.steps) * 1e3,
        )
    assert float(cache[3, 0, 7, 0, 0].cpu()) == 1.0, "the indexed write did not land"
