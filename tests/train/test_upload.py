"""The per-worker checkpoint uploader (tpuray.train.checkpoint.uploads) in this process: snapshots, the order in which
report records are released (only once their files are uploaded), upload errors, in-place writes.

Two small fsspec filesystems stand in for slow and failing object stores: a local filesystem whose
`put` waits for a gate, and one whose `put` fails after copying the first file."""

from __future__ import annotations

import os
import shutil
import threading

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from tpuray.train import CheckpointConfig, CheckpointUploadError, CheckpointUploadMode
from tpuray.train.checkpoint import PARTIAL_SUFFIX
from tpuray.train.checkpoint.uploads import (
    SNAPSHOT_PREFIX,
    CheckpointUploadTimeout,
    UploadQueue,
    parse_upload_mode,
)
from tpuray.train.session import ReportRecord
from tpuray.validation import ConfigError

ASYNC, SYNC = CheckpointUploadMode.ASYNC, CheckpointUploadMode.SYNC


class GatedFileSystem(LocalFileSystem):
    """Local files behind a `put` that waits until `gate` is set (an upload that is still running)."""

    protocol = ("tpuray-gated",)
    gate = threading.Event()
    entered = threading.Event()

    def put(self, lpath, rpath, recursive=False, **kwargs):
        type(self).entered.set()
        assert type(self).gate.wait(60), "the test never opened the gate"
        return super().put(lpath, rpath, recursive=recursive, **kwargs)


class FailingFileSystem(LocalFileSystem):
    """Local files behind a `put` that copies the first file, then fails (a connection lost mid-upload)."""

    protocol = ("tpuray-failing",)

    def put(self, lpath, rpath, recursive=False, **kwargs):
        first = sorted(os.listdir(lpath))[0]
        self.makedirs(rpath, exist_ok=True)
        shutil.copy(os.path.join(lpath, first), os.path.join(self._strip_protocol(rpath), first))
        raise ConnectionError("connection reset by peer")


fsspec.register_implementation("tpuray-gated", GatedFileSystem, clobber=True)
fsspec.register_implementation("tpuray-failing", FailingFileSystem, clobber=True)


@pytest.fixture
def gate():
    GatedFileSystem.gate.clear()
    GatedFileSystem.entered.clear()
    yield GatedFileSystem.gate
    GatedFileSystem.gate.set()


def _ckpt(path, **files: bytes) -> str:
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return str(path)


def _rec(index: int, ckpt: bool = True) -> ReportRecord:
    return ReportRecord(index, {"i": index}, ckpt)


def _indices(queue: UploadQueue) -> list[int]:
    return [r.index for r in queue.drain()]


def test_async_report_returns_before_the_upload_and_holds_records_until_it_ends(tmp_path, gate) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "c0", **{"model.bin": b"w" * 4096})
    dest = f"tpuray-gated://{tmp_path}/run/checkpoint_000000"
    queue.add(_rec(0), src, dest, ASYNC)  # returns although put() is blocked on the gate
    assert GatedFileSystem.entered.wait(60)
    queue.add(_rec(1, ckpt=False), None, "", ASYNC)  # a report without checkpoint waits behind it
    assert _indices(queue) == []  # nothing is committed while checkpoint_000000 is uploading
    shutil.rmtree(src)  # the loop may delete its directory: report() took a snapshot
    gate.set()
    queue.finish()
    assert _indices(queue) == [0, 1]
    assert (tmp_path / "run" / "checkpoint_000000" / "model.bin").read_bytes() == b"w" * 4096
    assert not [p for p in os.listdir(tmp_path) if p.startswith(SNAPSHOT_PREFIX)]  # snapshots removed


def test_sync_report_returns_after_the_upload(tmp_path) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "c0", **{"a.bin": b"a"})
    queue.add(_rec(0), src, str(tmp_path / "run" / "checkpoint_000000"), SYNC)
    assert _indices(queue) == [0]
    assert (tmp_path / "run" / "checkpoint_000000" / "a.bin").read_bytes() == b"a"
    queue.finish()


def test_upload_failing_mid_way_is_never_released_and_is_raised(tmp_path) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "c0", **{"a.bin": b"a", "b.bin": b"b"})
    queue.add(_rec(0), src, f"tpuray-failing://{tmp_path}/run/checkpoint_000000", ASYNC)
    with pytest.raises(CheckpointUploadError, match=r"checkpoint_000000 .*ConnectionError.*not committed"):
        queue.finish()
    assert (tmp_path / "run" / "checkpoint_000000" / "a.bin").exists()  # half of it made it...
    assert _indices(queue) == []  # ...but its record never leaves the worker: never committed
    with pytest.raises(CheckpointUploadError, match="checkpoint_000000"):  # and later reports say so
        queue.add(_rec(1, ckpt=False), None, "", ASYNC)


def test_local_upload_failing_mid_way_leaves_no_partial_file(tmp_path) -> None:
    queue = UploadQueue()
    dest = tmp_path / "run" / "checkpoint_000000"
    os.makedirs(dest / "b.bin")  # a directory where the second file goes: that file cannot be written
    src = _ckpt(tmp_path / "c0", **{"a.bin": b"a", "b.bin": b"b"})
    queue.add(_rec(0), src, str(dest), ASYNC)
    with pytest.raises(CheckpointUploadError, match=r"checkpoint_000000 from .*c0.*failed"):
        queue.wait()
    assert (dest / "a.bin").read_bytes() == b"a"
    assert not [n for n in os.listdir(dest) if PARTIAL_SUFFIX in n]
    assert _indices(queue) == []
    queue.close()


def test_file_written_in_place_while_uploading_fails_that_upload(tmp_path, gate) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "c0", **{"model.bin": b"old!"})
    queue.add(_rec(0), src, f"tpuray-gated://{tmp_path}/run/checkpoint_000000", ASYNC)
    assert GatedFileSystem.entered.wait(60)
    with open(os.path.join(src, "model.bin"), "wb") as f:  # in place: the snapshot's link sees it
        f.write(b"new content")
    gate.set()
    with pytest.raises(
        CheckpointUploadError, match=r"\['model.bin'\].*changed while they were being uploaded"
    ):
        queue.finish()
    assert _indices(queue) == []


def test_file_written_in_place_after_report_fails_the_next_report(tmp_path) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "reused", **{"model.bin": b"epoch 1"})
    queue.add(_rec(0), src, str(tmp_path / "run" / "checkpoint_000000"), ASYNC)
    queue.wait()
    assert _indices(queue) == [0]
    with open(os.path.join(src, "model.bin"), "wb") as f:  # torch.save over the same path does this
        f.write(b"epoch 2!")
    with pytest.raises(
        CheckpointUploadError, match=r"\['model.bin'\].*written in place.*checkpoint_upload_mode"
    ):
        queue.add(_rec(1), src, str(tmp_path / "run" / "checkpoint_000001"), ASYNC)
    queue.close()


def test_replacing_files_after_report_is_fine(tmp_path) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "reused", **{"model.bin": b"epoch 1"})
    for i in range(3):
        queue.add(_rec(i), src, str(tmp_path / "run" / f"checkpoint_{i:06d}"), ASYNC)
        tmp = os.path.join(src, "model.bin.tmp")
        with open(tmp, "wb") as f:
            f.write(f"epoch {i + 2}".encode())
        os.replace(tmp, os.path.join(src, "model.bin"))  # a new file under the old name: safe
    queue.finish()
    assert _indices(queue) == [0, 1, 2]
    assert (tmp_path / "run" / "checkpoint_000002" / "model.bin").read_bytes() == b"epoch 3"


def test_an_upload_that_never_ends_times_out_and_is_never_committed(tmp_path, gate) -> None:
    """ASYNC: the next wait gives up after the queue's timeout (the storage hangs), the error sticks, and
    the upload, should it end later, commits nothing; close() does not wait for the stuck thread."""
    queue = UploadQueue(timeout_s=0.5)
    src = _ckpt(tmp_path / "c0", **{"model.bin": b"w"})
    queue.add(_rec(0), src, f"tpuray-gated://{tmp_path}/run/checkpoint_000000", ASYNC)
    assert GatedFileSystem.entered.wait(60)
    inflight = queue._inflight[0]
    with pytest.raises(
        CheckpointUploadTimeout, match=r"checkpoint_000000 .*did not finish within 0.5s .*UPLOAD_TIMEOUT_S"
    ):
        queue.wait()
    with pytest.raises(CheckpointUploadTimeout):  # sticky: every later report says so
        queue.add(_rec(1, ckpt=False), None, "", ASYNC)
    queue.close()  # returns with the upload still stuck (the gate is closed)
    gate.set()
    inflight.result(timeout=60)  # the upload ends after all...
    assert _indices(queue) == []  # ...but its checkpoint stays uncommitted, as the error said


def test_a_sync_upload_that_never_ends_times_out(tmp_path, gate) -> None:
    queue = UploadQueue(timeout_s=0.5)
    src = _ckpt(tmp_path / "c0", **{"a.bin": b"a"})
    with pytest.raises(CheckpointUploadTimeout, match="checkpoint_000000"):
        queue.add(_rec(0), src, f"tpuray-gated://{tmp_path}/run/checkpoint_000000", SYNC)
    assert _indices(queue) == []
    queue.close()


def test_upload_timeout_env(monkeypatch) -> None:
    from tpuray.constants import DEFAULT_UPLOAD_TIMEOUT_S, UPLOAD_TIMEOUT_ENV
    from tpuray.train.worker import upload_timeout_s

    monkeypatch.delenv(UPLOAD_TIMEOUT_ENV, raising=False)
    assert upload_timeout_s() == DEFAULT_UPLOAD_TIMEOUT_S
    monkeypatch.setenv(UPLOAD_TIMEOUT_ENV, "42")
    assert upload_timeout_s() == 42.0
    monkeypatch.setenv(UPLOAD_TIMEOUT_ENV, "never")
    with pytest.raises(ConfigError, match=f"{UPLOAD_TIMEOUT_ENV}='never' is invalid"):
        upload_timeout_s()


def test_special_files_and_missing_directories_are_refused_at_report(tmp_path) -> None:
    queue = UploadQueue()
    src = _ckpt(tmp_path / "c0", **{"a.bin": b"a"})
    os.mkfifo(os.path.join(src, "pipe"))
    with pytest.raises(ValueError, match="pipe.*is not a regular file"):
        queue.add(_rec(0), src, str(tmp_path / "run" / "checkpoint_000000"), ASYNC)
    with pytest.raises(ValueError, match="does-not-exist.*does not exist"):
        queue.add(_rec(1), str(tmp_path / "does-not-exist"), str(tmp_path / "run" / "x"), ASYNC)
    queue.close()


def test_upload_mode_values() -> None:
    assert parse_upload_mode("async", "x") is ASYNC and parse_upload_mode("SYNC", "x") is SYNC
    from ray.train import CheckpointUploadMode as RayMode

    assert parse_upload_mode(RayMode.SYNC, "x") is SYNC and parse_upload_mode(RayMode.ASYNC, "x") is ASYNC
    with pytest.raises(ConfigError, match="NO_UPLOAD.*not supported"):
        parse_upload_mode(RayMode.NO_UPLOAD, "report(checkpoint_upload_mode)")
    assert CheckpointConfig().checkpoint_upload_mode is ASYNC
    assert CheckpointConfig(checkpoint_upload_mode="sync").checkpoint_upload_mode is SYNC
    with pytest.raises(
        ConfigError, match=r"CheckpointConfig.checkpoint_upload_mode='later' is invalid.*'async'"
    ):
        CheckpointConfig(checkpoint_upload_mode="later")
    with pytest.raises(ConfigError, match="checkpoint_upload_mode=True"):
        CheckpointConfig(checkpoint_upload_mode=True)  # type: ignore[arg-type]
