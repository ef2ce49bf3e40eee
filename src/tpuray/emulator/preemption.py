"""Emulated spot preemption: a notice through Ray's real drain API, the hosts killed at the deadline, and
(optionally) a replacement brought back later, as GKE's node pool would.

    p = cluster.preempt_slice("emulated-v6e-4-0", notice_s=10, restore_after_s=30)
    p.wait_killed()      # the hosts are gone (Ray reports them dead)
    p.wait_restored()    # replacements are up (same slice name, worker ids, labels, env)
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from tpuray.slices.drain import request_drain
from tpuray.validation import ConfigError, is_number

logger = logging.getLogger(__name__)

# Replacement hosts start from this one long-lived thread: Ray ties a node's processes to the thread that
# started them (they die with it, PR_SET_PDEATHSIG), so a short-lived timer thread cannot start them.
_NODE_STARTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-host-restore")


def _check_seconds(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_number(value) or value < 0:  # type: ignore[operator]
        raise ConfigError(f"{name}={value!r} is invalid: use seconds >= 0{' or None' if allow_none else ''}")


class Hosts(Protocol):
    """What a preemption needs of its cluster (`tpuray.emulator.EmulatedCluster` is one)."""

    @property
    def address(self) -> str: ...

    def kill_host(self, node_id: str, timeout_s: float = ...) -> tuple[str, int]: ...

    def restore_host(self, token: tuple[str, int]) -> str: ...


class Preemption:
    """One emulated preemption of some hosts: drained now, killed at `deadline`, maybe restored later."""

    def __init__(
        self,
        cluster: Hosts,
        node_ids: list[str],
        notice_s: float,
        restore_after_s: float | None = None,
        message: str = "",
    ) -> None:
        _check_seconds("notice_s", notice_s)
        _check_seconds("restore_after_s", restore_after_s, allow_none=True)
        if not node_ids:
            raise ConfigError("a preemption needs at least one emulated TPU host")
        self.cluster = cluster
        self.node_ids = list(node_ids)
        self.notice_s = float(notice_s)
        self.restore_after_s = restore_after_s
        self.noticed_at = time.time()
        self.deadline = self.noticed_at + self.notice_s  # UNIX seconds
        self.restored_node_ids: list[str] = []
        self.error: BaseException | None = None
        self._killed = threading.Event()
        self._restored = threading.Event()
        self._restore_lock = threading.Lock()  # restore() and restore_after_s never both bring hosts back
        self._tokens: list[tuple[str, int]] = []
        deadline_ms = int(self.deadline * 1000)
        why = message or f"emulated spot preemption ({self.notice_s:g}s notice)"
        for node_id in self.node_ids:
            request_drain(cluster.address, node_id, deadline_ms, why)
        logger.warning(
            "EMULATED preemption: draining %d host(s) %s, killing them in %.1fs",
            len(self.node_ids),
            [n[:12] for n in self.node_ids],
            self.notice_s,
        )
        self._thread = threading.Thread(target=self._run, name="emulated-preemption", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            time.sleep(max(0.0, self.deadline - time.time()))
            for node_id in self.node_ids:
                self._tokens.append(self.cluster.kill_host(node_id))
            self._killed.set()
            if self.restore_after_s is None:
                return
            time.sleep(self.restore_after_s)
            self._restore_now()
        except BaseException as e:  # noqa: BLE001 - reported by wait_*()
            self.error = e
            logger.error("emulated preemption failed: %s", e)
        finally:
            self._killed.set()
            self._restored.set()

    def wait_killed(self, timeout_s: float | None = None) -> bool:
        """Block until the hosts are gone (or `timeout_s`); re-raises a failure of the preemption itself."""
        done = self._killed.wait(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"emulated preemption failed: {self.error}") from self.error
        return done

    def wait_restored(self, timeout_s: float | None = None) -> bool:
        if self.restore_after_s is None:
            raise RuntimeError("this preemption brings no replacement back (restore_after_s=None)")
        done = self._restored.wait(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"emulated preemption failed: {self.error}") from self.error
        return done

    def restore(self) -> list[str]:
        """Bring replacements back now (after the kill); a no-op once they are back (restore_after_s)."""
        self.wait_killed()
        self._restore_now()
        return self.restored_node_ids

    def _restore_now(self) -> None:
        with self._restore_lock:
            if self.restored_node_ids:
                return
            tokens = list(self._tokens)
            self.restored_node_ids = _NODE_STARTER.submit(
                lambda: [self.cluster.restore_host(t) for t in tokens]
            ).result()

    @property
    def killed(self) -> bool:
        return self._killed.is_set()

    def __repr__(self) -> str:
        left = self.deadline - time.time()
        state = "killed" if self.killed else f"killing in {left:.1f}s"
        return f"Preemption(EMULATED, hosts={[n[:12] for n in self.node_ids]}, {state})"
