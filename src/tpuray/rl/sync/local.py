"""What one process keeps from one weight sync to the next, in one place, owned by the process: its
tpu_dist group memberships (`tpuray.rl.sync.collective.member`), a trainer rank's last update sent over
tpu_dist and the buffers it packs updates into (`tpuray.rl.sync.trainer`), the pieces a colocated
trainer rank staged for the mailbox to take (`tpuray.rl.sync.mailbox.stage`) and a colocated hand-over
waiting for this process's engine rank (`tpuray.rl.sync.handover.keep`).

`local()` is this process's one `LocalSync`; `reset()` closes its groups and drops the rest. It runs at
exit too: gloo left running to interpreter exit can abort the process there (runtime/dist.py).
"""

from __future__ import annotations

import atexit
from typing import Any

from tpuray.rl.weights.buffers import BufferPool


class LocalSync:
    """This process's side of the RL weight syncs it takes part in (see the module docstring)."""

    def __init__(self) -> None:
        self.groups: dict[
            tuple[str, int, int, int], Any
        ] = {}  # SyncGroup by (host, port, generation, engine)
        self.last_sent: dict[
            tuple[str, int], Any
        ] = {}  # a trainer rank's last tpu_dist update, by rendezvous
        self.send_buffers = BufferPool()  # what a trainer rank packs its updates into (reused)
        self.staged: dict[str, list[Any]] = {}  # a trainer rank's pieces waiting for Mailbox.hand_over
        self.handed: dict[str, dict[str, Any]] = {}  # a colocated hand-over for this process's engine rank

    def reset(self) -> None:
        """Close every group and drop everything kept."""
        while self.groups:
            self.groups.popitem()[1].close()
        self.last_sent.clear()
        self.send_buffers.clear()
        self.staged.clear()
        self.handed.clear()


_LOCAL: list[LocalSync] = []  # this process's one LocalSync, made at the first `local()`


def local() -> LocalSync:
    """This process's `LocalSync` (made at the first call, reset at exit)."""
    if not _LOCAL:
        _LOCAL.append(LocalSync())
        atexit.register(_LOCAL[0].reset)
    return _LOCAL[0]
