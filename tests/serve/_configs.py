"""Serving configs shared by the serve tests."""

from __future__ import annotations

MAX_MODEL_LEN = 256


def in_process_server(model_id: str, model_dir: str, max_model_len: int = MAX_MODEL_LEN):
    """The embedded engine and its OpenAI layer in this process (float32: comparable with transformers)."""
    from tpuray.serve.llm import LLMConfig
    from tpuray.serve.llm.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(
        LLMConfig(
            model_loading_config={"model_id": model_id, "model_source": model_dir},
            llm_engine="embedded",
            engine_kwargs={"max_model_len": max_model_len, "dtype": "float32"},
        )
    )


def tiny_tp4_config(tiny_model_dir: str, chips_per_worker: int = 1, **engine_kwargs):
    """The seed's serving config, shrunk: the tiny model, TP=4 over a v6e 2x2 slice (`chips_per_worker`
    4: one worker holding the 4 chips, TP=1)."""
    from tpuray.serve.llm import LLMConfig, ModelLoadingConfig

    return LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id="tiny", model_source=tiny_model_dir),
        llm_engine="embedded",
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        placement_group_config={"bundle_per_worker": {"TPU": chips_per_worker}},
        engine_kwargs={
            "tensor_parallel_size": 4 // chips_per_worker,
            "max_model_len": MAX_MODEL_LEN,
            "enable_expert_parallel": True,
            **engine_kwargs,
        },
    )
