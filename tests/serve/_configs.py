"""Serving configs shared by the serve tests."""

from __future__ import annotations

MAX_MODEL_LEN = 256


def tiny_tp4_config(tiny_model_dir: str):
    """The seed's serving config, shrunk: the tiny model, TP=4 over a v6e 2x2 slice."""
    from tpuray.serve.llm import LLMConfig, ModelLoadingConfig

    return LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id="tiny", model_source=tiny_model_dir),
        llm_engine="embedded",
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        placement_group_config={"bundle_per_worker": {"TPU": 1}},
        engine_kwargs={
            "tensor_parallel_size": 4,
            "max_model_len": MAX_MODEL_LEN,
            "enable_expert_parallel": True,
        },
    )
