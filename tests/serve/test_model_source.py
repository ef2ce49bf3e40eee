"""Model sources: a local directory, a Hugging Face Hub id (from a cache populated here, never the
network) and fsspec URLs (file://; gs:// and s3:// need their fsspec packages)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpuray.optional import MissingDependency
from tpuray.serve.llm import model_source
from tpuray.validation import ConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(home: Path, repo: str, model_dir: str) -> Path:
    """The Hugging Face cache layout (hub/models--org--name/{refs/main, snapshots/<commit>/...})."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model_dir, root / "snapshots" / COMMIT)
    return root / "snapshots" / COMMIT


def test_kinds():
    assert model_source.kind("gs://bucket/m") == "url" and model_source.kind("file:///x") == "url"
    assert model_source.kind("org/name") == "hub" and model_source.kind("gpt2") == "hub"
    assert model_source.kind("/does/not/exist") == "local" and model_source.kind("a/b/c") == "local"


def test_local_directory(tiny_model_dir):
    model_source.check(tiny_model_dir)
    assert model_source.resolve(tiny_model_dir) == str(Path(tiny_model_dir).resolve())
    with pytest.raises(ConfigError, match=r"'/does/not/exist' is not a model directory"):
        model_source.check("/does/not/exist")


def test_hub_id_from_the_local_cache_honours_hf_home(tiny_model_dir, tmp_path):
    snapshot = _hf_cache(tmp_path / "hf", "tpuray/tiny", tiny_model_dir)
    code = (
        "import json\nfrom tpuray.serve.llm import model_source as m\n"
        "m.check('tpuray/tiny')\nout = {'path': m.resolve('tpuray/tiny'), 'heads': m.read_config('tpuray/tiny')"
        "['num_attention_heads']}\n"
        "try:\n    m.check('tpuray/missing')\nexcept ValueError as e:\n    out['missing'] = str(e)\n"
        "print(json.dumps(out))"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["path"]) == snapshot and out["heads"] == 16
    assert "'tpuray/missing' (a Hugging Face Hub id) is not in the local Hugging Face cache" in out["missing"]


def test_file_url_is_downloaded_once(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TPURAY_MODEL_CACHE", str(tmp_path / "cache"))
    url = Path(tiny_model_dir).as_uri()
    model_source.check(url)
    assert model_source.read_config(url)["num_attention_heads"] == 16
    local = Path(model_source.resolve(url))
    assert local.parent == tmp_path / "cache" and (local / "config.json").is_file()
    assert (local / "model.safetensors").read_bytes() == (
        Path(tiny_model_dir) / "model.safetensors"
    ).read_bytes()
    marker = local / model_source.COMPLETE
    stamp = marker.stat().st_mtime_ns
    assert model_source.resolve(url) == str(local) and marker.stat().st_mtime_ns == stamp  # reused
    with pytest.raises(ConfigError, match=r"has no config.json"):
        model_source.check((tmp_path / "empty").as_uri())


def test_cloud_urls_name_the_package_they_need():
    with pytest.raises(MissingDependency, match=r"needs the 's3fs' package"):
        model_source.check("s3://bucket/model")


def test_embedded_engine_serves_a_file_url(tiny_model_dir, tmp_path, monkeypatch):
    import asyncio

    from tpuray.serve.llm import LLMConfig
    from tpuray.serve.llm.engine.embedded import EmbeddedEngine
    from tpuray.serve.llm.engine.sampling import SamplingParams

    monkeypatch.setenv("TPURAY_MODEL_CACHE", str(tmp_path / "cache"))
    cfg = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": Path(tiny_model_dir).as_uri()},
        llm_engine="embedded",
        engine_kwargs={"max_model_len": 64, "max_num_seqs": 2},
    )
    engine = EmbeddedEngine(cfg)

    async def go() -> int:
        outs = [
            o
            async for o in engine.generate(
                engine.encode_prompt("ab"), SamplingParams(max_tokens=3, temperature=0)
            )
        ]
        return outs[-1].completion_tokens

    try:
        assert asyncio.run(go()) == 3
    finally:
        engine.shutdown()
