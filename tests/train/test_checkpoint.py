"""Checkpoint directories on local disk and fsspec URLs (file://, memory:// within one process)."""

from __future__ import annotations

import os

import pytest

from tpuray.train import Checkpoint
from tpuray.train import checkpoint as ckpt


def _make(dir_path) -> str:
    os.makedirs(os.path.join(dir_path, "sub"), exist_ok=True)
    with open(os.path.join(dir_path, "model.pt"), "w") as f:
        f.write("weights")
    with open(os.path.join(dir_path, "sub", "meta.txt"), "w") as f:
        f.write("meta")
    return str(dir_path)


@pytest.mark.parametrize("scheme", ["", "file://", "memory://"])
def test_upload_list_restore(tmp_path, scheme: str) -> None:
    src = _make(tmp_path / "src")
    run = f"{scheme}{tmp_path}/run" if scheme != "memory://" else f"memory://tpuray-test-{os.getpid()}/run"
    ckpt.ensure_dir(run)
    for index in (0, 3):
        ckpt.upload(src, ckpt.checkpoint_dir(run, index))
    assert ckpt.list_checkpoints(run) == [0, 3]

    restored = Checkpoint(ckpt.checkpoint_dir(run, 3))
    with restored.as_directory() as d:
        assert open(os.path.join(d, "sub", "meta.txt")).read() == "meta"
    out = restored.to_directory(str(tmp_path / "out"))
    assert open(os.path.join(out, "model.pt")).read() == "weights"

    ckpt.write_text(ckpt.join(run, "state.json"), "{}")
    assert ckpt.read_text(ckpt.join(run, "state.json")) == "{}"
    ckpt.delete(ckpt.checkpoint_dir(run, 0))
    assert ckpt.list_checkpoints(run) == [3]


def test_from_directory_is_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Checkpoint.from_directory("x").path == str(tmp_path / "x")
    assert Checkpoint.from_directory("file:///a/b").path == "file:///a/b"


def test_upload_missing_dir_is_clear(tmp_path) -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        ckpt.upload(str(tmp_path / "does-not-exist"), str(tmp_path / "dst"))


def test_outside_a_run_is_a_clear_error() -> None:
    from tpuray import train

    for fn in (lambda: train.report({"a": 1}), train.get_context, train.get_checkpoint):
        with pytest.raises(RuntimeError, match="only works inside train_loop_per_worker"):
            fn()
