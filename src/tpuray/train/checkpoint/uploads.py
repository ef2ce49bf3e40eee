"""Checkpoint upload behind `report(metrics, checkpoint=...)`: synchronous, or on a per-worker background
thread (`CheckpointUploadMode.ASYNC`, the default).

A worker hands a report's record to the driver (`UploadQueue.drain()`) only once every file of that
report's checkpoint is in storage, in report order: the worker's half of the commit rule (written out,
with the driver's half, in `tpuray.train.checkpoint.manager`). On local storage each file is written
under a temporary name and renamed into place, so no file is ever seen half-written under its own name.

ASYNC. `report()` takes a *snapshot* of the directory and returns; the upload runs meanwhile:

* the snapshot hard-links every file into a hidden sibling directory (`.tpuray-snapshot-<pid>-...` next
  to the checkpoint directory): it costs no copy, and the files survive the directory being deleted,
  so deleting it, or replacing its files with new ones (a new file, `os.replace`), right after
  `report()` returns is safe. Where hard links are impossible (another filesystem, no write access to
  the parent) the files are copied instead, before `report()` returns (a warning says so once).
* a linked file shares its content with yours: do NOT write into an existing checkpoint file (open it
  for writing, `torch.save` over it) until the next `report()` returns. tpuray checks: a file changed
  while it was uploading fails that upload, and a file changed in place since the last report fails the
  next `report()`, both with `CheckpointUploadError` naming the file. Write each checkpoint into a new
  directory (`tempfile.TemporaryDirectory()`, as Ray Train's examples do), or use SYNC.
* at most one upload per worker is in flight: the next `report()` with a checkpoint first waits for the
  previous upload. An upload error is raised by the next `report()`, or when the training function
  returns (the worker waits for its uploads before it finishes), as a `CheckpointUploadError` naming the
  checkpoint: the run fails with it like any error in the training function.

SYNC uploads inside `report()` (Ray Train's default): when it returns the files are in storage.

Bound. No wait on an upload is unbounded: one that does not end within `$TPURAY_TRAIN_UPLOAD_TIMEOUT_S`
(default 1800 s; the driver reads it and hands it to its workers) raises `CheckpointUploadTimeout` from
`report()` (or when the training function returns); that checkpoint is never committed, and the trainer
treats the error as a worker failure (a restart from the last committed checkpoint, counted against
`FailureConfig(max_failures)`), as it would a host lost mid-upload.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import stat
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from tpuray.constants import DEFAULT_UPLOAD_TIMEOUT_S, UPLOAD_TIMEOUT_ENV
from tpuray.train.checkpoint import same_dir, upload
from tpuray.validation import ConfigError

logger = logging.getLogger("tpuray.train")

SNAPSHOT_PREFIX = ".tpuray-snapshot-"


class CheckpointUploadMode(enum.Enum):
    """How `report()` uploads a checkpoint (mirrors `ray.train.CheckpointUploadMode`)."""

    ASYNC = "ASYNC"  # snapshot, return, upload on the worker's upload thread (tpuray's default)
    SYNC = "SYNC"  # upload before report() returns (Ray Train's default)


def parse_upload_mode(value: Any, what: str) -> CheckpointUploadMode:
    """CheckpointUploadMode from itself, Ray's CheckpointUploadMode, or "async"/"sync" (any case)."""
    if isinstance(value, CheckpointUploadMode):
        return value
    raw = getattr(value, "value", value)  # ray.train.CheckpointUploadMode.SYNC -> "SYNC"
    if isinstance(raw, str) and raw.upper() in CheckpointUploadMode.__members__:
        return CheckpointUploadMode(raw.upper())
    if isinstance(raw, str) and raw.upper() == "NO_UPLOAD":
        raise ConfigError(
            f"{what}={value!r} is not supported by tpuray.train: write the files straight into "
            "<run_path>/checkpoint_<index> (tpuray then copies nothing) and use 'sync' or 'async'."
        )
    raise ConfigError(
        f"{what}={value!r} is invalid; valid: 'async', 'sync' (or tpuray.train.CheckpointUploadMode.ASYNC/SYNC)"
    )


class CheckpointUploadError(RuntimeError):
    """A checkpoint could not be uploaded completely; it is not committed."""


class CheckpointUploadTimeout(CheckpointUploadError):
    """An upload did not end within $TPURAY_TRAIN_UPLOAD_TIMEOUT_S (storage unreachable or too slow); the
    trainer counts it as a worker failure and restarts from the last committed checkpoint."""


# ---- snapshots ------------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """The files one ASYNC report() uploads: hard links in `path` (or copies when `linked` is empty)."""

    index: int
    source: str  # the directory passed to report()
    path: str
    linked: dict[str, tuple[int, int]] = field(default_factory=dict)  # relpath -> (size, mtime_ns)

    def changed_files(self) -> list[str]:
        """Linked files whose content changed since the snapshot (written in place through the source)."""
        changed = []
        for rel, (size, mtime) in self.linked.items():
            try:
                st = os.stat(os.path.join(self.path, rel))
            except OSError:
                changed.append(rel)
                continue
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                changed.append(rel)
        return changed

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


_warned_copy: set[str] = set()


def take_snapshot(source: str, index: int) -> Snapshot:
    """Hard-link `source`'s files into a hidden sibling directory; copy them where links fail."""
    files = _regular_files(source)
    parent = os.path.dirname(os.path.abspath(source).rstrip("/")) or "/"
    staging = None
    try:
        staging = tempfile.mkdtemp(prefix=f"{SNAPSHOT_PREFIX}{os.getpid()}-{index:06d}-", dir=parent)
        linked = {}
        for rel, path in files:
            target = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.link(path, target)
            st = os.stat(target)
            linked[rel] = (st.st_size, st.st_mtime_ns)
        return Snapshot(index, source, staging, linked)
    except OSError as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if parent not in _warned_copy:
            _warned_copy.add(parent)
            logger.warning(
                "tpuray.train: cannot hard-link checkpoint files under %s (%s); report() copies them "
                "before it returns, then uploads the copy in the background",
                parent,
                exc,
            )
    copy = tempfile.mkdtemp(prefix=f"tpuray-snapshot-{os.getpid()}-{index:06d}-")
    try:
        for rel, path in files:
            target = os.path.join(copy, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(path, target)
    except BaseException:
        shutil.rmtree(copy, ignore_errors=True)
        raise
    return Snapshot(index, source, copy)


def _regular_files(source: str) -> list[tuple[str, str]]:
    """(relpath, path) of every file under `source` (symlinks followed); ValueError for anything that is
    not a regular file (pipes, sockets, devices, dangling links)."""
    out = []
    for root, dirs, names in os.walk(source, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError as exc:
                raise ValueError(
                    f"checkpoint file {path!r} cannot be read ({exc}); is it a dangling symlink?"
                ) from exc
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(
                    f"checkpoint file {path!r} is not a regular file (mode {stat.filemode(st.st_mode)}): a "
                    "checkpoint holds regular files and directories only"
                )
            out.append((os.path.relpath(path, source), path))
    return out


# ---- the per-worker queue -------------------------------------------------------------------------------
class UploadQueue:
    """One per worker session: uploads report()'s checkpoints and hands report records to `drain()` in
    report order, each only once its checkpoint's files are all uploaded."""

    def __init__(self, timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s  # the longest wait for one upload
        self._lock = threading.Lock()
        self._ready: list[Any] = []  # records the driver may drain
        self._held: list[Any] = []  # records waiting behind the upload in flight
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: tuple[Future, int, str] | None = None  # (future, checkpoint index, destination)
        self._error: CheckpointUploadError | None = None
        self._stuck = False  # an upload outlived timeout_s: its thread is abandoned
        self._last: Snapshot | None = None

    def add(self, record: Any, source: str | None, dest: str, mode: CheckpointUploadMode) -> None:
        """Queue one report's record; with `source` (a local directory), upload it to `dest` first."""
        if source is None:
            self.raise_if_failed()
            with self._lock:
                (self._held if self._held else self._ready).append(record)
            return
        if not os.path.isdir(source):
            raise ValueError(f"checkpoint directory {source!r} does not exist or is not a directory")
        self.wait()  # at most one upload in flight: the previous one first (raises its error)
        self._check_last(record.index)
        if same_dir(source, dest):  # the loop wrote straight into the run's checkpoint directory
            with self._lock:
                self._ready.append(record)
            return
        if mode is CheckpointUploadMode.SYNC:  # on the upload thread too, so that the wait is bounded
            try:
                self._await(self._executor().submit(upload, source, dest), record.index, dest)
            except CheckpointUploadTimeout:
                raise
            except Exception as exc:
                raise CheckpointUploadError(_failed(record.index, source, dest, exc)) from exc
            with self._lock:
                self._ready.append(record)
            return
        snap = take_snapshot(source, record.index)
        self._last = snap
        with self._lock:
            self._held.append(record)
        self._inflight = (self._executor().submit(self._upload, snap, dest), record.index, dest)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpuray-ckpt-upload")
        return self._pool

    def _await(self, future: Future, index: int, dest: str) -> None:
        """future.result() within timeout_s; past it, CheckpointUploadTimeout (sticky, never committed)."""
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            if future.done():  # the upload itself raised a TimeoutError (3.11+: the same class)
                raise
            error = CheckpointUploadTimeout(
                f"uploading checkpoint_{index:06d} to {dest!r} did not finish within {self.timeout_s:g}s "
                f"(${UPLOAD_TIMEOUT_ENV}): the storage is unreachable or too slow. It is not committed; the "
                "trainer restarts the workers from the last committed checkpoint (a worker failure, "
                "FailureConfig(max_failures))"
            )
            with self._lock:
                self._stuck = True
                self._error = error
            logger.error("tpuray.train: %s", error)
            raise error from None

    def _upload(self, snap: Snapshot, dest: str) -> None:
        try:
            upload(snap.path, dest)
            changed = snap.changed_files()
            if changed:
                raise CheckpointUploadError(
                    f"checkpoint_{snap.index:06d}: file(s) {changed!r} of {snap.source!r} changed while they "
                    "were being uploaded (written in place after report() returned), so the uploaded copy "
                    "may be torn; it is not committed. " + _ADVICE
                )
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next report() / finish()
            if isinstance(exc, CheckpointUploadError):
                error = exc
            else:
                error = CheckpointUploadError(_failed(snap.index, snap.source, dest, exc))
                error.__cause__ = exc
            with self._lock:
                self._error = self._error or error
            logger.error("tpuray.train: %s", error)
            return  # the held records stay held: this checkpoint is never committed
        with self._lock:
            if self._stuck:  # it ended after its wait gave up: it stays uncommitted, as the error said
                return
            self._ready.extend(self._held)
            self._held.clear()

    def _check_last(self, index: int) -> None:
        last, self._last = self._last, None
        if last is None:
            return
        changed = last.changed_files()
        if self._pool is not None:  # freeing large files takes ms: do it on the upload thread
            self._pool.submit(last.remove)
        else:
            last.remove()
        if changed:
            raise CheckpointUploadError(
                f"report() of checkpoint_{index:06d}: file(s) {changed!r} of {last.source!r}, reported with "
                f"checkpoint_{last.index:06d}, were written in place after that report() returned, while "
                "tpuray may still have been uploading them. " + _ADVICE
            )

    def drain(self) -> list[Any]:
        with self._lock:
            records, self._ready = self._ready, []
        return records

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Wait for the upload in flight (at most timeout_s); raise the first upload error (it stays
        raised: sticky)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not self._stuck:
            self._await(*inflight)  # _upload itself never raises
        self.raise_if_failed()

    def finish(self) -> None:
        """End of the training function: wait for the last upload (raising its error); drop snapshots."""
        try:
            self.wait()
        finally:
            self.close()

    def close(self) -> None:
        """Wait for an upload in flight (at most timeout_s) without raising, remove the snapshot, stop the
        thread (an upload thread that outlived its wait is abandoned, not joined)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not self._stuck:
            try:
                self._await(*inflight)
            except CheckpointUploadTimeout:
                pass  # logged; the caller is already failing or finishing
        last, self._last = self._last, None
        if last is not None:
            last.remove()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=not self._stuck, cancel_futures=True)


_ADVICE = (
    "With checkpoint_upload_mode ASYNC (tpuray's default) report() hard-links the files and uploads them "
    "in the background: write each checkpoint into a new directory (tempfile.TemporaryDirectory()) or new "
    "files, or use CheckpointConfig(checkpoint_upload_mode='sync')."
)


def _failed(index: int, source: str, dest: str, exc: BaseException) -> str:
    return (
        f"uploading checkpoint_{index:06d} from {source!r} to {dest!r} failed: {type(exc).__name__}: {exc}; "
        "it is not committed (the run resumes from the previous committed checkpoint)"
    )
