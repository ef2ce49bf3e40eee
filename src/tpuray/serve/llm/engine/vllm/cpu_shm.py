"""The shared memory of vLLM's CPU all-reduce, left behind by nothing tpuray starts.

vLLM's CPU backend (its CPU build; emulated TPU slices) joins the ranks of each tensor-parallel group
through shared-memory segments, one per rank, named "<ident>-<group>-[<ranks>]-cpushm_<i>" where ident is
the port of the engine's init method. vLLM never removes them: every engine start left 4 MiB per rank in
/dev/shm. And the external launcher's "env://" (colocated vLLM) has no port, so every such run on a host
took the same names, and the first run's leftovers failed each later start (EEXIST).

`release_cpu_shm` removes the names once every rank has mapped its group's segments (vLLM's barrier after
joining them): the mappings live on until their processes end, and a killed worker leaves nothing.
`cpu_shm_names_of_this_run` gives the external launcher's groups names of their own.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SHM_ROOT = Path("/dev/shm")


def release_cpu_shm(names: Sequence[str], root: Path = SHM_ROOT) -> None:
    """Remove the segments' names of vLLM's CPU groups `names` ("<name>_<i>" for each rank i)."""
    for name in set(names):
        for path in root.glob(glob.escape(name) + "_*"):
            path.unlink(missing_ok=True)


def release_engine_cpu_shm(ident: str, root: Path = SHM_ROOT) -> None:
    """Remove the segments' names of every CPU group of the engine whose init method's port is `ident`
    (vLLM's VLLM_DIST_IDENT); nothing for an ident without a port of its own."""
    ident = ident.strip("/")
    if ident:
        for path in root.glob(f"{glob.escape(ident)}-*-cpushm_*"):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def cpu_shm_names_of_this_run(made: list[str]) -> Iterator[None]:
    """While vLLM builds its groups in this process, their names start with "tpuray<MASTER_PORT>-" (the
    trainer group's port: the same on every rank of a run, as vLLM checks) instead of the external
    launcher's empty ident; each name is added to `made`."""
    from vllm.distributed.device_communicators import cpu_communicator

    run = os.environ.get("MASTER_PORT", "")
    if not run:  # each rank's own stand-in would disagree, and vLLM would drop its shared memory unsaid
        raise RuntimeError(
            "colocated vLLM names its CPU groups' shared memory by MASTER_PORT, which is unset"
        )
    shm = cpu_communicator._CPUSHMDistributed
    original = shm.__dict__["make_group_name"]

    def make_group_name(communicator: Any) -> str:
        name = f"tpuray{run}-" + original.__func__(communicator).lstrip("/-")
        made.append(name)
        return name

    shm.make_group_name = staticmethod(make_group_name)
    try:
        yield
    finally:
        shm.make_group_name = original
