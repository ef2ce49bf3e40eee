"""Whether vLLM can run a model here, decided from its config.json before vLLM starts.

vLLM builds an engine for a model its attention backend cannot compute: on its CPU backend (vLLM's CPU
build, and tpuray's emulated TPU slices, which run that backend per chip) the engine core starts, and the
first request kills it ("Unsupported CPU attention configuration: head_dim=8"), after which every request
fails with EngineDeadError. The rule is vLLM's own and read from the installed vLLM, not restated here:
`CPUAttentionBackend.get_supported_head_sizes()` (vllm/v1/attention/backends/cpu_attn.py; the CPU platform
always picks that backend for non-MLA models, vllm/platforms/cpu.py `get_attn_backend_cls`).

On other platforms (vLLM-TorchTPU on real TPU chips) nothing is decided from config.json; when the engine
starts, a dtype the platform would not honour is refused (`dtype_problem`: vLLM-TorchTPU computes in
bfloat16 only), and the replica's warm-up generation (a 1-token request before it reports ready) catches a
model the engine cannot run there.
"""

from __future__ import annotations

from typing import Any

from tpuray.validation import ConfigError


def head_dim(model_config: dict[str, Any]) -> int | None:
    """The attention head size, as vLLM derives it (ModelConfig.get_head_size): `head_dim` when the
    config has one, else hidden_size // num_attention_heads."""
    explicit = model_config.get("head_dim")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = model_config.get("hidden_size"), model_config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def attention_head_sizes() -> tuple[str, list[int]] | None:
    """(vLLM's platform, the head sizes its attention backend supports) where vLLM computes on this
    machine's CPU; None elsewhere (the rule is then the platform's own, checked by the warm-up)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return type(current_platform).__name__, list(CPUAttentionBackend.get_supported_head_sizes())


def model_problem(model_config: dict[str, Any]) -> str | None:
    """Why vLLM cannot run this model on this platform (the model's property and what vLLM supports);
    None when nothing here says it cannot."""
    if model_config.get("kv_lora_rank"):  # MLA models take vLLM's MLA backends: another rule
        return None
    size = head_dim(model_config)
    supported = attention_head_sizes() if size is not None else None
    if supported is None or size in supported[1]:
        return None
    platform, sizes = supported
    shape = {k: model_config.get(k) for k in ("hidden_size", "num_attention_heads")}
    derived = f" ({', '.join(f'{k}={v}' for k, v in shape.items())})" if None not in shape.values() else ""
    return (
        f"head_dim={size}{derived} is not supported by vLLM's CPU attention backend ({platform}, "
        f"CPU_ATTN); valid head sizes: {sizes}"
    )


class VLLMCannotServe(ConfigError):
    """vLLM on this platform cannot serve the model as configured; found when the engine starts, before it
    loads or compiles anything (llm_engine "auto" then serves the model with the embedded engine)."""


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype_problem(asked: Any, resolved: Any, platform: str) -> str | None:
    """Why vLLM's engine configuration does not honour engine_kwargs['dtype']: the platform replaced the
    dtype asked for (vLLM-TorchTPU computes in bfloat16 and turns float32 and float16 into it, logging only
    a warning); None when it is honoured or none was asked for."""
    if asked is None or asked == "auto":
        return None
    got = str(resolved).removeprefix("torch.")
    if _DTYPE_ALIASES.get(asked, asked) == got:
        return None
    return (
        f"vLLM on {platform} computes in {got}, not dtype={asked!r} (engine_kwargs); use dtype={got!r} or "
        "'auto' with vLLM, or llm_engine='embedded' (or 'auto'), whose engine computes in the dtype asked for"
    )


def auto_prefers_embedded(switch: str = "llm_engine='vLLM'") -> str | None:
    """Why "auto" runs the embedded engine here although vLLM is installed; None where vLLM runs. On
    vLLM-TorchTPU's platform (a real TPU) the embedded engine measured faster on every figure
    (docs/real-tpu.md, "Serving and RL with vLLM-TorchTPU"), compiles nothing while serving and sleeps for RL
    (vLLM's sleep mode is refused there); `switch` (serving's llm_engine='vLLM', RL's engine='vllm')
    still selects vLLM there."""
    from vllm.platforms import current_platform

    platform = type(current_platform).__name__
    if platform != "TpuPlatform":
        return None
    return (
        f"on {platform} (vLLM-TorchTPU) the embedded engine decodes faster (batch 1, batch 32, mixed "
        "requests), answers a prompt faster, starts faster (first and again), compiles nothing while "
        f"serving and sleeps (vLLM's sleep mode is refused there): set {switch} to run vLLM"
    )
