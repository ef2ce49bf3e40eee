"""A whole-slice plan as plain data (what `tpuray plan --json` prints) and as text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpuray.constants import CLOUD_TPU_TASK_ID_ENV, TPU_VISIBLE_CHIPS_ENV, TPU_WORKER_ID_ENV
from tpuray.topology.env import (
    DEFAULT_PROCESS_PORT,
    default_hostnames,
    multislice_env,
    num_processes,
    worker_envs,
)
from tpuray.topology.slice import SliceTopology
from tpuray.validation import ConfigError, check_positive_int

# Entries of worker_env that differ between processes of a slice; the rest is common.
PER_PROCESS_KEYS = (TPU_WORKER_ID_ENV, TPU_VISIBLE_CHIPS_ENV, "TPU_PROCESS_PORT", CLOUD_TPU_TASK_ID_ENV)


def slice_hostnames(topo: SliceTopology, num_slices: int, slice_id: int) -> list[str]:
    """Default hostnames; with several slices each gets its own prefix ("v6e-16-s1-w0")."""
    hosts = default_hostnames(topo)
    if num_slices == 1:
        return hosts
    if topo.num_hosts == 1:
        return [f"{topo.pod_type}-s{slice_id}"]
    return [f"{topo.pod_type}-s{slice_id}-w{i}" for i in range(topo.num_hosts)]


def _check_slices(num_slices: int) -> None:
    check_positive_int("num_slices", num_slices)


def plan_dict(
    topo: SliceTopology,
    num_slices: int = 1,
    chips_per_process: int = 1,
    hostnames: Sequence[Sequence[str]] | None = None,
    port_base: int = DEFAULT_PROCESS_PORT,
) -> dict[str, Any]:
    """Everything about running `num_slices` copies of `topo`: sizes, layout, per-process env.

    `hostnames` is one list per slice (default: `slice_hostnames`). The env of each process is
    `env_common` of its slice merged with its `per_process` entry (and MEGASCALE_* for multi-slice).
    """
    _check_slices(num_slices)
    if hostnames is not None and len(hostnames) != num_slices:
        raise ConfigError(f"hostnames must hold one list per slice ({num_slices}), got {hostnames!r}")
    gen = topo.generation
    nproc = num_processes(topo, chips_per_process)
    slices, per_process = _slice_envs(topo, num_slices, chips_per_process, hostnames, port_base)
    return {
        "generation": gen.family,
        "codename": gen.codename,
        "accelerator_type": gen.accelerator_type,
        "topology": topo.topology,
        "pod_type": topo.pod_type,
        "head_resource": topo.head_resource,
        "num_slices": num_slices,
        "shape": list(topo.shape),
        "wraparound": list(topo.wraparound),
        "chips": topo.num_chips,
        "devices_per_chip": gen.devices_per_chip,
        "cores_per_chip": gen.cores_per_chip,
        "hosts": topo.num_hosts,
        "chips_per_host": topo.chips_per_host,
        "host_shape": list(topo.host_shape),
        "host_bounds": list(topo.host_bounds),
        "chips_per_process": chips_per_process,
        "processes_per_slice": nproc,
        "layout": [
            {"rank": p.rank, "host": p.host, "local_chip": p.local_chip, "coords": list(p.coords)}
            for p in topo.layout()
        ],
        "slices": slices,
        "per_process": per_process,
    }


def _slice_envs(
    topo: SliceTopology,
    num_slices: int,
    chips_per_process: int,
    hostnames: Sequence[Sequence[str]] | None,
    port_base: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each slice's hostnames and common env (MEGASCALE_* for multi-slice), and the per-process env of
    the first slice (the others' are the same)."""
    slices = []
    per_process: list[dict[str, Any]] = []
    for s in range(num_slices):
        hosts = list(hostnames[s]) if hostnames else slice_hostnames(topo, num_slices, s)
        envs = worker_envs(topo, hosts, chips_per_process, port_base)
        common = {k: v for k, v in envs[0].items() if k not in PER_PROCESS_KEYS}
        if num_slices > 1:
            common.update(multislice_env(f"{slice_hostnames(topo, num_slices, 0)[0]}", num_slices, s))
        slices.append({"slice_id": s, "hostnames": hosts, "env_common": common})
        if s == 0:
            per_process = [{"rank": r, **{k: e[k] for k in PER_PROCESS_KEYS}} for r, e in enumerate(envs)]
    return slices, per_process


def _wrap_text(wrap: list[bool]) -> str:
    dims = [str(d) for d, w in enumerate(wrap) if w]
    return f"on dims {','.join(dims)} (torus)" if dims else "none"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def mesh_lines(topo: SliceTopology, max_chips: int = 512) -> list[str]:
    """Rank numbers laid out on the chip mesh, one grid per z-plane (rows: dim 0, columns: dim 1)."""
    if topo.num_chips > max_chips:
        return [f"  (mesh of {topo.num_chips} chips not drawn; use --limit 0 to show it)"]
    a, b, c = topo.shape
    width = len(str(topo.num_chips - 1)) + 1
    out = []
    for z in range(c):
        if c > 1:
            out.append(f"  z={z}")
        for x in range(a):
            cells = []
            for y in range(b):
                r = topo.rank_of((x, y, z))
                sep = "|" if y and y % topo.host_shape[1] == 0 else " "
                cells.append(sep + str(r).rjust(width))
            out.append("  " + "".join(cells))
            if x + 1 < a and (x + 1) % topo.host_shape[0] == 0:
                out.append("  " + "-" * (len(cells) * (width + 1)))
    return out


def plan_text(plan: dict[str, Any], topo: SliceTopology, limit: int = 64) -> str:
    """Human-readable report of `plan_dict(...)`; at most `limit` ranks listed (0: all)."""
    p = plan
    name = p["generation"] + (f" ({p['codename']})" if p["codename"] else "")
    lines = [
        f"TPU slice plan: {name} {p['topology']} - pod type {p['pod_type']}, "
        f"Ray accelerator_type {p['accelerator_type']}",
        f"  slices            {p['num_slices']}",
        f"  chips             {p['chips']} per slice ({p['chips'] * p['num_slices']} total), "
        f"{p['cores_per_chip']} TensorCore(s) and {p['devices_per_chip']} device(s) per chip",
        f"  hosts             {p['hosts']} per slice, {p['chips_per_host']} chips each",
        f"  mesh              {'x'.join(map(str, p['shape']))} chips, hosts "
        f"{'x'.join(map(str, p['host_bounds']))} of {'x'.join(map(str, p['host_shape']))}, "
        f"ICI wraparound {_wrap_text(p['wraparound'])}",
        f"  head resource     {p['head_resource']}",
        f"  processes         {p['processes_per_slice']} per slice, {p['chips_per_process']} chip(s) each",
        "",
        "Mesh (rank per chip; '|' and '-' separate hosts):",
        *mesh_lines(topo, max_chips=topo.num_chips if limit == 0 else 512),
        "",
        "Rank layout (slice 0):",
    ]
    lines += _layout_lines(p, limit) + _env_lines(p, limit)
    return "\n".join(lines)


def _layout_lines(p: dict[str, Any], limit: int) -> list[str]:
    """The rank layout table of slice 0 (at most `limit` ranks; 0: all)."""
    hosts0 = p["slices"][0]["hostnames"]
    shown = p["layout"] if limit == 0 else p["layout"][:limit]
    rows = [["rank", "worker", "chip", "coords", "hostname"]]
    rows += [
        [
            str(e["rank"]),
            str(e["host"]),
            str(e["local_chip"]),
            ",".join(map(str, e["coords"])),
            hosts0[e["host"]],
        ]
        for e in shown
    ]
    lines = _table(rows)
    if len(shown) < len(p["layout"]):
        lines.append(f"  ... {len(p['layout']) - len(shown)} more (use --limit 0 to list all)")
    return lines


def _env_lines(p: dict[str, Any], limit: int) -> list[str]:
    """Each slice's common environment, then the per-process one (long values cut unless limit is 0)."""
    lines: list[str] = []
    for s in p["slices"]:
        lines += ["", f"Environment common to every process of slice {s['slice_id']}:"]
        for k, v in s["env_common"].items():
            if limit and len(v) > 160:
                v = v[:120] + f"... ({v.count(',') + 1} entries)"
            lines.append(f"  {k}={v}")
    lines += ["", "Per-process environment (every slice):"]
    procs = p["per_process"] if limit == 0 else p["per_process"][:limit]
    rows = [["rank", *PER_PROCESS_KEYS]]
    rows += [[str(e["rank"]), *(e[k] for k in PER_PROCESS_KEYS)] for e in procs]
    lines += _table(rows)
    if len(procs) < len(p["per_process"]):
        lines.append(f"  ... {len(p['per_process']) - len(procs)} more")
    return lines
