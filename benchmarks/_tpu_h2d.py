"""Host-to-chip copies of a model's weights for bench_real_tpu.py (`h2d`): the plain per-tensor `.to(chip)`
of the Llama-shaped checkpoint's state dict (the anchor: what the embedded engine's loader and the raw
transfer of `vllm-weights` do) beside the other paths torch_tpu 0.2.0 offers, each timed once to the last
byte on the chip (one sync), and checked: a few tensors read back and compared with the host's.

Paths: per tensor `.to(chip, non_blocking=True)` (torch_tpu then keeps the host tensor alive and does not
wait for each copy); `copy_(non_blocking=True)` into tensors already on the chip (an RL commit's form);
per-tensor copies from several threads; the state packed into one flat host buffer, copied once and split
into per-tensor tensors on the chip (`unpack_s`); the flat buffer in chunks, from pageable or pinned host
memory (`pin_memory`: torch_tpu's TpuPinnedAllocator, memory from libtpu's host allocator); torch_tpu's
raw DMA `batch_transfer_h2d` of the flat chunks, and of each tensor (raw bytes: right only where the
chip's layout of a shape is row-major, which `bytes_ok` shows).

torch_tpu reads TPU_PREMAPPED_BUFFER_SIZE once, when it loads (at `import torch`), and hands it to libtpu
as the size of its premapped (pinned, DMA-mapped) host buffer, 0 when unset; libtpu reads
TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES (the largest transfer staged through that buffer) itself.
Without the buffer every copy takes libtpu's staged slow path with a DMA map and unmap per transfer
(vLLM-TorchTPU 0.29's env_override.py: ~0.4 GB/s; it sets 16 GiB where its own KV transfers run).
So each `--premapped` setting runs in a process of its own: the script starts itself once per setting,
one after the other (one process holds the chip), and ends with a summary against the anchor of the
setting `unset` (what tpuray runs with today). A setting starts no path after --h2d-budget-s seconds of
its paths (at 0.27 GB/s each path of a 2.2 GB state takes 8 s), so the likeliest gains come first."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from _tpu_engine import sync, synced

Report = Callable[..., None]
SIZE_ENV, THRESHOLD_ENV = "TPU_PREMAPPED_BUFFER_SIZE", "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES"
SETTING_ENV = "TPURAY_H2D_SETTING"  # set in a setting's process: the --premapped entry it measures
ALIGN = 4  # elements: each tensor of the flat buffer starts at a multiple (8 bytes for bf16)
TILE = 1024  # elements: a chunk is a multiple, so a 1-D chunk fills whole tiles on the chip
CHECK_MAX_BYTES = 64 << 20  # tensors read back to check a path are at most this big


def add_options(ap) -> None:
    ap.add_argument(
        "--premapped",
        default="4294967296/4294967296,unset",
        help="h2d: settings, comma-separated, one process each: SIZE[/THRESHOLD] bytes "
        f"({SIZE_ENV} and {THRESHOLD_ENV}) or 'unset' (torch_tpu then passes 0 to libtpu)",
    )
    ap.add_argument("--h2d-paths", default=",".join(PATHS), help=f"h2d: paths ({', '.join(PATHS)})")
    ap.add_argument("--h2d-threads", type=int, default=4, help="h2d: threads of the `threads` path")
    ap.add_argument("--h2d-chunk-mb", type=int, default=64, help="h2d: MiB per chunk of the flat buffer")
    ap.add_argument(
        "--h2d-budget-s",
        type=float,
        default=40.0,
        help="h2d: a setting starts no path after this many seconds of its paths (the rest: skipped)",
    )


def parse_setting(entry: str) -> dict[str, str]:
    """The environment of one --premapped entry (SIZE[/THRESHOLD] or 'unset'); ValueError otherwise."""
    size, _, threshold = entry.partition("/")
    env = {} if size == "unset" else {SIZE_ENV: size}
    if threshold:
        env[THRESHOLD_ENV] = threshold
    if any(not v.isdigit() for v in env.values()) or int(env.get(SIZE_ENV, "0")) % 4096:
        raise ValueError(
            f"--premapped entry {entry!r} is not valid; valid: 'unset' or SIZE[/THRESHOLD] in bytes "
            "(SIZE a multiple of 4096, e.g. 4294967296/4294967296)"
        )
    return env


def selected_paths(args) -> list[str]:
    names = args.h2d_paths.split(",")
    unknown = sorted(set(names) - set(PATHS))
    if unknown or args.h2d_threads < 1 or args.h2d_chunk_mb < 1:
        raise ValueError(
            f"h2d: paths {unknown}, --h2d-threads {args.h2d_threads}, --h2d-chunk-mb "
            f"{args.h2d_chunk_mb}: valid are paths from {', '.join(PATHS)} and counts >= 1"
        )
    return [p for p in PATHS if p in names]  # in PATHS's order: the anchor first


def starts_settings() -> bool:
    """Whether this process starts one process per setting (it is none of them)."""
    return SETTING_ENV not in os.environ


# -- the launcher: one process per setting --------------------------------------------------------------
def run_settings(args, report: Report, checkpoint: Callable) -> None:
    """Each --premapped setting in a process of its own (this script again), its JSON lines passed on;
    then `h2d_summary`: every path's seconds by setting, the anchor and the fastest path whose bytes
    landed."""
    settings = args.premapped.split(",")
    for entry in settings:
        parse_setting(entry)
    selected_paths(args)
    if args.model_dir is None:  # one checkpoint for every setting, written here once
        args.model_dir = tempfile.mkdtemp(prefix="tpuray-h2d-")
    checkpoint(args)
    rows: list[dict] = []
    for entry in settings:
        env = {k: v for k, v in os.environ.items() if k not in (SIZE_ENV, THRESHOLD_ENV)}
        env |= parse_setting(entry) | {SETTING_ENV: entry}
        cmd = [sys.executable, sys.argv[0], *sys.argv[1:], "--model-dir", args.model_dir]
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                rows += [r for r in _json_row(line) if r.get("name") == "h2d"]
        if proc.returncode:
            report("h2d_setting_failed", premapped=entry, returncode=proc.returncode)
    report("h2d_summary", **summary(rows))


def _json_row(line: str) -> list[dict]:
    try:
        row = json.loads(line)
    except ValueError:
        return []
    return [row] if isinstance(row, dict) else []


def summary(rows: list[dict]) -> dict[str, Any]:
    """Every path's seconds by setting and (`vs_anchor`) against the anchor: `to` of the setting `unset`
    where it ran (what tpuray runs with today), else the first `to`; the fastest path whose bytes landed."""
    timed = [r for r in rows if "seconds" in r]
    anchors = [r for r in timed if r["path"] == "to"]
    anchor = next((r for r in anchors if r["premapped"] == "unset"), anchors[0] if anchors else None)
    out: dict[str, Any] = {"seconds": {}, "vs_anchor": {}}
    for r in timed:
        out["seconds"].setdefault(r["premapped"], {})[r["path"]] = r["seconds"]
        if anchor and anchor["seconds"] > 0:  # rows come rounded (4 places): 0 for a tiny model on a CPU
            out["vs_anchor"].setdefault(r["premapped"], {})[r["path"]] = round(
                r["seconds"] / anchor["seconds"], 3
            )
    landed = [r for r in timed if r.get("bytes_ok")]
    best = min(landed, key=lambda r: r["seconds"]) if landed else None
    if anchor:
        out |= {"anchor": f"{anchor['premapped']} to", "anchor_s": anchor["seconds"]}
    if best:
        out |= {
            "best": f"{best['premapped']} {best['path']}",
            "best_s": best["seconds"],
            "best_gb_s": best["gb_s"],
        }
        out["best_vs_anchor"] = out["vs_anchor"].get(best["premapped"], {}).get(best["path"])
    return out


# -- one setting: every path in this process ------------------------------------------------------------
@dataclass
class Landed:
    """What a path left on the chip: `read(name)` reads one tensor back to the host; `unpack`, where
    given, makes per-tensor tensors of it on the chip (timed apart); `keep` holds the device buffers."""

    read: Callable[[str], torch.Tensor]
    unpack: Callable[[], Landed] | None = None
    keep: Any = None


def tensors_landed(moved: dict[str, torch.Tensor]) -> Landed:
    return Landed(read=lambda k: moved[k].cpu(), keep=moved)


@dataclass
class Flat:
    """The state's tensors packed into one 1-D host buffer of their dtype, each at a multiple of ALIGN
    elements, zero-padded to whole chunks of `chunk` elements; `used` elements hold the tensors."""

    host: torch.Tensor
    spans: dict[str, tuple[int, tuple[int, ...]]]  # name -> (first element, shape)
    chunk: int
    used: int
    pack_s: float

    @classmethod
    def pack(cls, state: dict[str, torch.Tensor], chunk_bytes: int) -> Flat:
        dtypes = sorted({str(t.dtype) for t in state.values()})
        if len(dtypes) != 1:
            raise ValueError(f"h2d packs a state dict of one dtype; this one has {dtypes}")
        dtype = next(iter(state.values())).dtype
        spans, at = {}, 0
        for name, t in state.items():
            spans[name] = (at, tuple(t.shape))
            at += -(-t.numel() // ALIGN) * ALIGN
        chunk = min(max(TILE, chunk_bytes // dtype.itemsize // TILE * TILE), -(-at // TILE) * TILE)
        t0 = time.perf_counter()
        host = torch.empty(-(-at // chunk) * chunk, dtype=dtype)
        host[at:].zero_()
        for name, t in state.items():
            o, n = spans[name][0], t.numel()
            host[o : o + n].copy_(t.reshape(-1))
            host[o + n : o + -(-n // ALIGN) * ALIGN].zero_()
        return cls(host, spans, chunk, at, time.perf_counter() - t0)

    def landed(self, pieces: list[torch.Tensor], scale: int = 1) -> Landed:
        """The flat buffer on the chip as `pieces` (all but the last of the same size), each element of
        them `scale` elements of the host buffer (2: int32 pieces of a bf16 buffer)."""
        return Landed(read=lambda k: self.read(pieces, k, scale), keep=pieces)

    def read(self, pieces: list[torch.Tensor], name: str, scale: int) -> torch.Tensor:
        o, shape = self.spans[name]
        n, size = math.prod(shape), pieces[0].numel()
        lo, hi = o // scale, -(-(o + n) // scale)
        parts = []
        for i in range(lo // size, (hi - 1) // size + 1):
            a, b = max(lo, i * size) - i * size, min(hi, (i + 1) * size) - i * size
            parts.append(pieces[i][a:b].cpu())
        got = torch.cat(parts).view(self.host.dtype)
        return got[o - lo * scale : o - lo * scale + n].view(shape)


@dataclass
class Case:
    state: dict[str, torch.Tensor]
    flat: Flat
    device: torch.device
    threads: int
    nbytes: int = 0
    checks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        small = [k for k, t in self.state.items() if t.numel() * t.element_size() <= CHECK_MAX_BYTES]
        self.checks = sorted({small[0], small[len(small) // 2], small[-1]}) if small else []


Prepared = tuple[Callable[[], Landed], dict[str, Any]]  # the timed call, figures of its untimed set-up


def to_each(case: Case, non_blocking: bool = False) -> Prepared:
    def run() -> Landed:
        return tensors_landed(
            {k: t.to(case.device, non_blocking=non_blocking) for k, t in case.state.items()}
        )

    return run, {}


def copy_into(case: Case) -> Prepared:
    dest = {k: torch.empty_like(t, device=case.device) for k, t in case.state.items()}

    def run() -> Landed:
        for k, t in case.state.items():
            dest[k].copy_(t, non_blocking=True)
        return tensors_landed(dest)

    return run, {}


def threads(case: Case) -> Prepared:
    names = sorted(case.state, key=lambda k: -case.state[k].numel())  # the big ones first, spread

    def run() -> Landed:
        with ThreadPoolExecutor(case.threads) as pool:
            moved = pool.map(lambda k: case.state[k].to(case.device), names)
            return tensors_landed(dict(zip(names, moved, strict=True)))

    return run, {"threads": case.threads}


def flat(case: Case) -> Prepared:
    f = case.flat

    def unpack(piece: torch.Tensor) -> Landed:
        return tensors_landed(
            {k: piece[o : o + math.prod(s)].view(s).clone() for k, (o, s) in f.spans.items()}
        )

    def run() -> Landed:
        piece = f.host[: f.used].to(case.device)
        return Landed(read=f.landed([piece]).read, unpack=lambda: unpack(piece), keep=piece)

    return run, {"host_pack_s": f.pack_s}


def chunks(case: Case, pinned: bool = False) -> Prepared:
    f = case.flat
    figures: dict[str, Any] = {"host_pack_s": f.pack_s}
    host = f.host[: f.used]
    if pinned:
        t0 = time.perf_counter()
        host = torch.empty_like(host, pin_memory=True).copy_(host)
        figures |= {"pin_s": time.perf_counter() - t0, "is_pinned": host.is_pinned()}
    pieces = host.split(f.chunk)
    figures |= {"chunks": len(pieces), "chunk_mb": f.chunk * f.host.element_size() / 2**20}

    def run() -> Landed:
        return f.landed([p.to(case.device, non_blocking=True) for p in pieces])

    return run, figures


def batch_chunks(case: Case) -> Prepared:
    from torch_tpu._internal.batch_transfer import batch_transfer_h2d

    f = case.flat
    src = [p.view(torch.int32) for p in f.host.split(f.chunk)]  # 1-D int32: whole tiles, one shape
    dst = [torch.empty_like(s, device=case.device) for s in src]

    def run() -> Landed:
        batch_transfer_h2d(src, dst).wait()  # raw DMA; not on torch_tpu's streams: waited here
        return f.landed(dst, scale=4 // f.host.element_size())  # host elements per int32

    return run, {"chunks": len(src), "chunk_mb": f.chunk * f.host.element_size() / 2**20}


def batch_tensors(case: Case) -> Prepared:
    from torch_tpu._internal.batch_transfer import batch_transfer_h2d

    dst = {k: torch.empty_like(t, device=case.device) for k, t in case.state.items()}

    def run() -> Landed:
        futures = [batch_transfer_h2d([t.contiguous()], [dst[k]]) for k, t in case.state.items()]
        for fut in futures:
            fut.wait()
        return tensors_landed(dst)

    return run, {}


PATHS: dict[str, Callable[[Case], Prepared]] = {  # in this order: the anchor, then the likeliest gains
    "to": to_each,
    "to_nonblocking": lambda c: to_each(c, non_blocking=True),
    "flat": flat,
    "pinned_chunks": lambda c: chunks(c, pinned=True),
    "batch_chunks": batch_chunks,
    "chunks_nonblocking": chunks,
    "copy_nonblocking": copy_into,
    "threads": threads,
    "batch_tensors": batch_tensors,
}


def measure(name: str, case: Case) -> dict[str, Any]:
    """One path, timed from its first copy to the chip's last byte (sync); `unpack_s` after it where the
    path lands one buffer; whether the checked tensors read back equal the host's. An error is the
    figure (its type and message)."""
    try:
        run, figures = PATHS[name](case)
        seconds, landed = synced(run)
        if landed.unpack is not None:
            t1 = time.perf_counter()
            landed = landed.unpack()
            sync()
            figures["unpack_s"] = time.perf_counter() - t1
        ok = all(torch.equal(landed.read(k), case.state[k]) for k in case.checks)
    except Exception as e:  # noqa: BLE001 - the exact error is the figure
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    return {"seconds": seconds, "gb_s": case.nbytes / seconds / 1e9, "bytes_ok": ok, **figures}


def run_paths(args, report: Report, checkpoint: Callable) -> None:
    """This process's setting (SETTING_ENV, or the environment as found): `h2d_setup`, then one `h2d`
    row per path, with its seconds against the anchor's (`to`) in the same process."""
    from tpuray.serve.llm.engine.embedded.model import load_state_dict

    entry = os.environ.get(SETTING_ENV, "as found")
    paths = selected_paths(args)
    path, _ = checkpoint(args)
    t0 = time.perf_counter()
    state = load_state_dict(path)
    load_s = time.perf_counter() - t0
    case = Case(state, Flat.pack(state, args.h2d_chunk_mb << 20), torch.device(args.device), args.h2d_threads)
    report(
        "h2d_setup",
        premapped=entry,
        env={k: os.environ.get(k) for k in (SIZE_ENV, THRESHOLD_ENV)},
        eager_mode=_eager_mode(),
        weight_bytes=case.nbytes,
        tensors=len(state),
        checked=case.checks,
        load_s=load_s,
        host_pack_s=case.flat.pack_s,
    )
    torch.ones(TILE).to(case.device).cpu()  # the runtime's first transfer stays out of the timings
    anchor, start = None, time.perf_counter()
    for name in paths:
        if name != "to" and time.perf_counter() - start > args.h2d_budget_s:  # the anchor always runs
            report("h2d", premapped=entry, path=name, skipped=f"over --h2d-budget-s {args.h2d_budget_s}")
            continue
        row = measure(name, case)
        if name == "to":
            anchor = row.get("seconds")
        if anchor and "seconds" in row:
            row["vs_anchor"] = row["seconds"] / anchor
        report("h2d", premapped=entry, path=name, **row)
        gc.collect()  # the path's buffers on the chip go before the next path's


def _eager_mode() -> str | None:
    try:
        return str(torch.tpu.eager_mode)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no torch_tpu here, or no such property in this version
        return None
