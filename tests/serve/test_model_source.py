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

from _util import free_port
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
    from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine
    from tpuray.serve.llm.generation import SamplingParams

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


def test_cached_hub_id_needs_no_network_without_hf_hub_offline(tiny_model_dir, tmp_path):
    """HF_HUB_OFFLINE unset and the Hub unreachable (a closed local port as HF_ENDPOINT; this machine has
    no internet either): an id in the cache checks and reads from the cache; one not in it fails naming
    the source and the way out."""
    _hf_cache(tmp_path / "hf", "tpuray/tiny", tiny_model_dir)
    code = (
        "import json\nfrom tpuray.serve.llm import model_source as m\n"
        "m.check('tpuray/tiny')\nm.check('tpuray/tiny', 'tokenizer_source', m.TOKENIZER_FILES)\n"
        "out = {'heads': m.read_config('tpuray/tiny')['num_attention_heads']}\n"
        "try:\n    m.check('tpuray/missing')\nexcept ValueError as e:\n    out['missing'] = str(e)\n"
        "print(json.dumps(out))"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heads"] == 16
    missing = out["missing"]
    assert "'tpuray/missing' (a Hugging Face Hub id) is not in the local Hugging Face cache" in missing
    assert "the Hub cannot be reached" in missing and "HF_HUB_OFFLINE=1" in missing and "HF_HOME" in missing


def test_tokenizer_source_is_checked_at_build_openai_app(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from tpuray.serve.llm import build_openai_app

    tokenizer_dir = tmp_path / "tokenizer"  # a tokenizer alone: no config.json
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tokenizer_dir)

    def app(tokenizer_source: str):
        loading = {"model_id": "t", "model_source": tiny_model_dir, "tokenizer_source": tokenizer_source}
        return build_openai_app(
            {"llm_configs": [{"model_loading_config": loading, "llm_engine": "embedded"}]}
        )

    (config,), _, _ = app(str(tokenizer_dir))._bound_deployment.init_args  # the app carries it
    assert config.model_loading_config.tokenizer_source == str(tokenizer_dir)
    with pytest.raises(
        ConfigError, match=r"model 't': tokenizer_source '/does/not/exist' is not a tokenizer dir"
    ):
        app("/does/not/exist")
    with pytest.raises(
        ConfigError, match=r"tokenizer_source 'tpuray/no-tokenizer' \(a Hugging Face Hub id\)"
    ):
        app("tpuray/no-tokenizer")  # HF_HUB_OFFLINE=1 here (tests/conftest.py): the cache only


def _slice_config(url: str, host_cache: Path, accelerator_type: str, topology: str, tp: int):
    from tpuray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": url},
        llm_engine="embedded",
        accelerator_type=accelerator_type,
        accelerator_config={"kind": "tpu", "topology": topology},
        placement_group_config={"bundle_per_worker": {"TPU": 4}},
        engine_kwargs={"tensor_parallel_size": tp, "max_model_len": 64, "max_num_seqs": 2},
        runtime_env={"env_vars": {"TPURAY_MODEL_CACHE": str(host_cache)}},
    )


def _greedy(engine, prompt: str = "Hello world") -> list[int]:
    import asyncio

    from tpuray.serve.llm.generation import SamplingParams

    async def go() -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(
            engine.encode_prompt(prompt), SamplingParams(max_tokens=4, temperature=0)
        ):
            ids += out.token_ids
        return ids

    return asyncio.run(go())


def _check_resolved_on_hosts(engine, host_cache: Path, hosts: int) -> None:
    """Each host's workers load the copy made on that host, in the workers' environment (host_cache),
    not the replica's."""
    assert len({w["node_id"] for w in engine.worker_info}) == hosts
    for w in engine.worker_info:
        path = Path(w["model_path"])
        assert path.parent == host_cache and (path / model_source.COMPLETE).is_file(), w


def test_embedded_engine_on_a_slice_resolves_a_url_on_its_hosts(
    emulated_cluster, tiny_model_dir, tmp_path, monkeypatch
):
    from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine

    monkeypatch.setenv("TPURAY_MODEL_CACHE", str(tmp_path / "replica"))
    host_cache = tmp_path / "hosts"
    engine = EmbeddedEngine(_slice_config(Path(tiny_model_dir).as_uri(), host_cache, "TPU-V6E", "2x2", 1))
    try:
        _check_resolved_on_hosts(engine, host_cache, hosts=1)
        assert len(list((tmp_path / "replica").iterdir())) == 1  # the replica's own copy (tokenizer)
        assert len(_greedy(engine)) == 4
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_embedded_engine_on_a_two_host_slice_has_the_model_on_each_host(
    cluster_manager, tiny_model_dir, tmp_path, monkeypatch
):
    """A v4 2x2x2 slice is two 4-chip hosts: one worker (4 chips) per host, TP=2; both hosts resolve the
    URL and the sharded engine's greedy tokens equal the single-process engine's."""
    from tpuray.emulator import SliceRequest
    from tpuray.serve.llm import LLMConfig
    from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine

    cluster_manager.get(SliceRequest("TPU-V4", "2x2x2"), head_cpus=2)
    monkeypatch.setenv("TPURAY_MODEL_CACHE", str(tmp_path / "replica"))
    host_cache = tmp_path / "hosts"
    url = Path(tiny_model_dir).as_uri()
    engine = EmbeddedEngine(_slice_config(url, host_cache, "TPU-V4", "2x2x2", 2))
    try:
        _check_resolved_on_hosts(engine, host_cache, hosts=2)
        sharded = _greedy(engine)
    finally:
        engine.shutdown()
    local = EmbeddedEngine(
        LLMConfig(
            model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
            llm_engine="embedded",
            engine_kwargs={"max_model_len": 64, "max_num_seqs": 2},
        )
    )
    try:
        assert sharded == _greedy(local)
    finally:
        local.shutdown()
