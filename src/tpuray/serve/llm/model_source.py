"""Where a served model's files come from: a local directory, a Hugging Face Hub id, or an fsspec URL.

- a local directory (it exists): used in place;
- a Hub id (`org/name` or `name`, not a local path): `huggingface_hub.snapshot_download`, which honours
  `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and the local cache (`check` and `read_config` look in the
  cache first and go to the Hub only for an id that is not there);
- a URL (`gs://`, `s3://`, `file://`, any fsspec protocol): copied once into
  `$TPURAY_MODEL_CACHE` (default `~/.cache/tpuray/models`)/<hash of the URL>, reused afterwards.

`check()` runs at `build_openai_app` (before anything is reserved) and raises ConfigError naming the bad
source; `resolve()` runs where the model loads; `resolve_on_hosts()` runs it on every host of a slice, so
each host reads the model from its own disk at the same path.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tpuray.constants import MODEL_CACHE_ENV
from tpuray.optional import require
from tpuray.validation import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
URL = re.compile(r"^[a-z][a-z0-9+.-]*://")
COMPLETE = ".tpuray-complete"
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
FSSPEC_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs"}


def kind(source: str) -> str:
    """ "url", "local" or "hub"."""
    if URL.match(source):
        return "url"
    if Path(source).expanduser().exists() or not HUB_ID.match(source):
        return "local"
    return "hub"


def cache_dir() -> Path:
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "tpuray" / "models").expanduser()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _filesystem(url: str) -> tuple[Any, str]:
    fsspec = require("fsspec", "vllm", "model_source URLs")
    protocol = url.split("://", 1)[0]
    package = FSSPEC_PACKAGES.get(protocol)
    if package:
        require(package, "vllm", f"model_source {url!r}")
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"model_source {url!r}: fsspec cannot open it: {e}") from e


def check(source: str, what: str = "model_source", files: tuple[str, ...] = MODEL_FILES) -> None:
    """ConfigError naming `source` unless it can be loaded (without downloading the weights): it must
    hold one of `files` (a model's config.json; TOKENIZER_FILES for a tokenizer_source). A Hub id is
    looked up in the local Hugging Face cache first and on the Hub only when it is not there."""
    k = kind(source)
    need = " or ".join(files)
    if k == "local":
        path = Path(source).expanduser()
        if not any((path / f).is_file() for f in files):
            thing = "model" if files == MODEL_FILES else "tokenizer"
            raise ConfigError(
                f"{what} {source!r} is not a {thing} directory with a {need} (nor a Hugging Face Hub id "
                "like 'org/name', nor a URL like gs://bucket/dir)"
            )
        return
    if k == "url":
        fs, remote = _filesystem(source)
        try:
            found = any(fs.exists(f"{remote.rstrip('/')}/{f}") for f in files)
        except Exception as e:  # noqa: BLE001 - any storage error means it cannot be loaded
            raise ConfigError(f"{what} {source!r} cannot be read: {type(e).__name__}: {e}") from e
        if not found:
            raise ConfigError(f"{what} {source!r} has no {need}")
        return
    hub = require("huggingface_hub", "vllm", "model_source Hub ids")
    if any(_cached(hub, source, f) for f in files):
        return
    cache = hub.constants.HF_HUB_CACHE
    if _offline():
        raise ConfigError(
            f"{what} {source!r} (a Hugging Face Hub id) is not in the local Hugging Face cache ({cache}) "
            f"and HF_HUB_OFFLINE is set"
        )
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        hub.HfApi().model_info(source)
    except RepositoryNotFoundError as e:
        raise ConfigError(
            f"{what} {source!r} (a Hugging Face Hub id) is not on the Hub (or it is private or gated: set "
            f"HF_TOKEN): {type(e).__name__}"
        ) from e
    except Exception as e:  # noqa: BLE001 - the Hub cannot be reached
        raise ConfigError(
            f"{what} {source!r} (a Hugging Face Hub id) is not in the local Hugging Face cache ({cache}) and "
            f"the Hub cannot be reached ({type(e).__name__}: {e}); without internet, put the model in the "
            "cache HF_HOME (or HF_HUB_CACHE) points to and set HF_HUB_OFFLINE=1"
        ) from e


def _cached(hub: Any, repo: str, filename: str) -> str | None:
    """The cached copy of one file of a Hub repo (its main revision), or None."""
    found = hub.try_to_load_from_cache(repo, filename)
    return found if isinstance(found, str) else None


def read_config(source: str) -> dict[str, Any]:
    """The model's config.json (after `check`), without downloading the weights."""
    import json

    k = kind(source)
    if k == "local":
        return json.loads((Path(source).expanduser() / "config.json").read_text())
    if k == "url":
        fs, path = _filesystem(source)
        return json.loads(fs.cat(f"{path.rstrip('/')}/config.json"))
    hub = require("huggingface_hub", "vllm", "model_source Hub ids")
    cached = _cached(hub, source, "config.json")  # the local cache first: no network when it is there
    path = cached or hub.hf_hub_download(source, "config.json", local_files_only=_offline())
    return json.loads(Path(path).read_text())


def resolve(source: str) -> str:
    """A local directory holding the model (downloading it first if it is a Hub id or a URL)."""
    k = kind(source)
    if k == "local":
        return str(Path(source).expanduser().resolve())
    if k == "hub":
        hub = require("huggingface_hub", "vllm", "model_source Hub ids")
        return str(hub.snapshot_download(source, local_files_only=_offline()))
    target = cache_dir() / hashlib.sha256(source.encode()).hexdigest()[:16]
    if (target / COMPLETE).is_file():
        return str(target)
    fs, path = _filesystem(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        fs.get(path.rstrip("/") + "/", str(staging) + "/", recursive=True)
        (staging / COMPLETE).write_text(source)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def resolve_here(source: str) -> str:
    """`resolve` on this host, checked: the directory must hold the model's config.json here (a local
    directory given as model_source must exist on every host that loads it)."""
    import socket

    path = resolve(source)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_source {source!r}: {path} has no config.json on host {socket.gethostname()}; a local "
            "directory must exist on every host of the slice (or use a Hub id or a URL)"
        )
    return path


def resolve_on_hosts(source: str, strategies: list[Any], runtime_env: dict[str, Any] | None = None) -> str:
    """`resolve_here` on every host of a reservation, one zero-CPU task per host (`strategies`: a
    scheduling strategy into one bundle of each host) in the workers' `runtime_env` (their HF_HOME,
    TPURAY_MODEL_CACHE), so a Hub id or URL is downloaded once per host and every host reads the model
    from its own disk; the path, the same on every host."""
    import ray

    task = ray.remote(num_cpus=0)(resolve_here)
    refs = [task.options(scheduling_strategy=s, runtime_env=runtime_env).remote(source) for s in strategies]
    paths = set(ray.get(refs))
    if len(paths) != 1:
        raise RuntimeError(
            f"model_source {source!r} resolved to different paths on the slice's hosts: {paths}"
        )
    return paths.pop()
