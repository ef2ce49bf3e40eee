"""Checkpoint: a directory on local disk or any fsspec filesystem, plus the upload/list/delete helpers the
trainer uses to persist checkpoints under `<storage_path>/<name>/checkpoint_<index>`."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

CHECKPOINT_PREFIX = "checkpoint_"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


def _fs(url: str):
    import fsspec.core

    return fsspec.core.url_to_fs(url)


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


@dataclass(frozen=True)
class Checkpoint:
    """A directory of files. `path` is a local path or an fsspec URL (file://, s3://, gs://...)."""

    path: str

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        path = os.fspath(path)
        if "://" not in path:
            path = os.path.abspath(os.path.expanduser(path))
        return cls(path)

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint into a local directory (a new temp dir if `path` is None); return it."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="tpuray_ckpt_")
        os.makedirs(dest, exist_ok=True)
        if is_local(self.path):
            shutil.copytree(local_path(self.path), dest, dirs_exist_ok=True)
        else:
            fs, root = _fs(self.path)
            fs.get(root.rstrip("/") + "/", dest.rstrip("/") + "/", recursive=True)
        return dest

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """Yield a local directory with the checkpoint's files (the original one if already local)."""
        if is_local(self.path):
            yield local_path(self.path)
            return
        tmp = self.to_directory()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"


def checkpoint_dir(run_path: str, index: int) -> str:
    return join(run_path, f"{CHECKPOINT_PREFIX}{index:06d}")


PARTIAL_SUFFIX = ".tpuray-partial"  # a local file being uploaded, renamed into place once complete


def same_dir(src_dir: str, dest_url: str) -> bool:
    """`dest_url` is `src_dir` itself (the loop wrote straight into the run's checkpoint directory)."""
    return is_local(dest_url) and os.path.abspath(local_path(dest_url)) == os.path.abspath(src_dir)


def upload(src_dir: str, dest_url: str) -> None:
    """Copy a local directory's contents into `dest_url` (merged with what other ranks uploaded). Local
    destinations get each file under a temporary name, then renamed into place, so no file is ever seen
    half-written under its own name."""
    if not os.path.isdir(src_dir):
        raise ValueError(f"checkpoint directory {src_dir!r} does not exist or is not a directory")
    if same_dir(src_dir, dest_url):
        return
    if not is_local(dest_url):
        fs, root = _fs(dest_url)
        fs.makedirs(root, exist_ok=True)
        fs.put(src_dir.rstrip("/") + "/", root.rstrip("/") + "/", recursive=True)
        return
    dest = local_path(dest_url)
    suffix = f"{PARTIAL_SUFFIX}-{os.getpid()}"
    for root, dirs, files in os.walk(src_dir, followlinks=True):
        dirs.sort()
        rel = os.path.relpath(root, src_dir)
        target = dest if rel == "." else os.path.join(dest, rel)
        os.makedirs(target, exist_ok=True)
        for name in sorted(files):
            final = os.path.join(target, name)
            partial = final + suffix
            try:
                shutil.copy2(os.path.join(root, name), partial)
                os.replace(partial, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
                raise


def ensure_dir(url: str) -> None:
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
    else:
        fs, root = _fs(url)
        fs.makedirs(root, exist_ok=True)


def list_checkpoints(run_path: str) -> list[int]:
    """Indices of the checkpoint_<index> directories under a run path, sorted."""
    if is_local(run_path):
        root = local_path(run_path)
        names = os.listdir(root) if os.path.isdir(root) else []
    else:
        fs, root = _fs(run_path)
        names = (
            [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.exists(root) else []
        )
    return sorted(int(m.group(1)) for n in names if (m := _CHECKPOINT_RE.match(n)))


def delete(url: str) -> None:
    if is_local(url):
        shutil.rmtree(local_path(url), ignore_errors=True)
        return
    fs, root = _fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def write_text(url: str, text: str) -> None:
    """Write a small file atomically on local disk (write + rename), plainly elsewhere."""
    if is_local(url):
        path = local_path(url)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return
    fs, root = _fs(url)
    with fs.open(root, "w") as f:
        f.write(text)


def read_text(url: str) -> str | None:
    if is_local(url):
        path = local_path(url)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return f.read()
    fs, root = _fs(url)
    if not fs.exists(root):
        return None
    with fs.open(root, "r") as f:
        return f.read()
