"""Draw a slice's chip mesh with rank numbers, coloured by host (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tpuray.topology.slice import SliceTopology
from tpuray.validation import ConfigError

MAX_PANELS = 16  # z-planes drawn for large 3D slices
MAX_LABELLED_CHIPS = 512  # rank numbers are written when the drawn planes hold at most this many chips


def draw_mesh(topo: SliceTopology, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG of the mesh: one panel per z-plane (rows: dim 0, columns: dim 1)."""
    from tpuray.optional import require

    matplotlib = require("matplotlib", "plot", "tpuray plan --png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--png file must end in .png, got {str(path)!r}")
    if not path.parent.exists():
        raise ConfigError(f"directory {str(path.parent)!r} of --png file does not exist")
    a, b, c = topo.shape
    planes = min(c, MAX_PANELS)
    cols = min(planes, 4)
    rows = math.ceil(planes / cols)
    cell = 0.45 if a * b <= 64 else max(0.06, 8.0 / max(a, b))
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(max(4.0, cols * (b * cell + 0.8)), max(3.0, rows * (a * cell + 0.9))),
        squeeze=False,
    )
    cmap = plt.get_cmap("tab20")  # host h gets colour h % 20, so neighbouring hosts differ
    norm = matplotlib.colors.Normalize(vmin=0, vmax=19)
    label = planes * a * b <= MAX_LABELLED_CHIPS
    for z in range(rows * cols):
        ax = axes[z // cols][z % cols]
        ax.set_axis_off()
        if z < planes:
            _draw_plane(ax, topo, z, cmap, norm, label)
    n_hosts = topo.num_hosts
    more = f"; planes 0-{planes - 1} of {c} shown" if planes < c else ""
    fig.suptitle(
        title
        or f"{topo.generation.family} {topo.topology} ({topo.pod_type}): {topo.num_chips} chips, "
        f"{n_hosts} hosts; colour = host{' (20 colours, cycled)' if n_hosts > 20 else ''}{more}",
        fontsize=10,
    )
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=0.9, wspace=0.08, hspace=0.15)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw_plane(ax: Any, topo: SliceTopology, z: int, cmap: Any, norm: Any, label: bool) -> None:
    """Plane z of the mesh on `ax`: chips coloured by host, thin lines between chips, thick between hosts,
    each chip's rank written in it when `label`."""
    a, b, c = topo.shape
    sx, sy, _ = topo.host_shape
    ranks = [[topo.rank_of((x, y, z)) for y in range(b)] for x in range(a)]
    hosts = [[(r // topo.chips_per_host) % 20 for r in row] for row in ranks]
    ax.imshow(hosts, cmap=cmap, norm=norm, interpolation="nearest", extent=(0, b, a, 0))
    for y in range(1, b):
        ax.axvline(y, color="white", lw=1.6 if y % sy == 0 else 0.4)
    for x in range(1, a):
        ax.axhline(x, color="white", lw=1.6 if x % sx == 0 else 0.4)
    if c > 1:
        ax.set_title(f"z = {z}", fontsize=9)
    if label:
        font = max(4, min(10, int(220 / max(a, b))))
        for x in range(a):
            for y in range(b):
                ax.text(y + 0.5, x + 0.5, str(ranks[x][y]), ha="center", va="center", fontsize=font)
