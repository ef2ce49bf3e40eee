"""engine_kwargs -> vLLM's own arguments: AsyncEngineArgs (the engine) and FrontendArgs (its OpenAI layer).

Every key is either passed to vLLM or refused with an error naming it (nothing is dropped):
- keys of vLLM's AsyncEngineArgs go to the engine, keys of its FrontendArgs (chat_template,
  tool_call_parser, enable_auto_tool_choice, response_role, ...) to its OpenAI serving layer;
- keys that configure vLLM's own HTTP server (host, port, ssl_*, api_key, ...) are refused: Ray Serve is
  the HTTP server here (API key: LLMServingArgs.api_key);
- keys tpuray sets from the LLMConfig (model, tokenizer, served_model_name) are refused;
  tensor_parallel_size must match the reservation (checked by LLMConfig).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, Protocol

from tpuray.validation import ConfigError


class EngineFields(Protocol):
    """The part of an LLMConfig the split reads (kept apart: config.py imports this module)."""

    engine_kwargs: dict[str, Any]
    tensor_parallel_size: int
    log_engine_metrics: bool


SET_BY_TPURAY = {
    "model": "model_loading_config.model_source",
    "tokenizer": "model_loading_config.tokenizer_source",
    "served_model_name": "model_loading_config.model_id",
}
HTTP_SERVER_PREFIXES = ("ssl_", "allowed_", "uvicorn_", "h11_", "dp_supervisor_")
HTTP_SERVER_KEYS = {
    "host", "port", "uds", "api_key", "root_path", "middleware", "allow_credentials",
    "data_parallel_supervisor_port", "disable_fastapi_docs", "enable_offline_docs", "enable_ssl_refresh",
    "log_config_file", "disable_uvicorn_access_log", "disable_access_log_for_endpoints",
    "sse_keep_alive_interval", "enable_request_id_headers", "enable_server_load_tracking",
}  # fmt: skip
TPURAY_KEYS = {"task"}  # tpuray's own engine_kwargs (not vLLM's)


@cache
def _field_names() -> tuple[frozenset[str], frozenset[str]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    engine = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))
    frontend = frozenset(f.name for f in dataclasses.fields(FrontendArgs)) - engine
    return engine, frontend


def split_engine_kwargs(config: EngineFields) -> tuple[dict[str, Any], dict[str, Any]]:
    """(AsyncEngineArgs kwargs, FrontendArgs kwargs) from config.engine_kwargs; ConfigError names a key
    that cannot be honoured."""
    engine_fields, frontend_fields = _field_names()
    engine: dict[str, Any] = {}
    frontend: dict[str, Any] = {}
    for key, value in config.engine_kwargs.items():
        if key in TPURAY_KEYS:
            continue
        if key in SET_BY_TPURAY:
            raise ConfigError(
                f"engine_kwargs[{key!r}] is set by tpuray from {SET_BY_TPURAY[key]}; set that instead"
            )
        if key in HTTP_SERVER_KEYS or key.startswith(HTTP_SERVER_PREFIXES):
            raise ConfigError(
                f"engine_kwargs[{key!r}] configures vLLM's own HTTP server, which tpuray does not run: Ray "
                "Serve serves the OpenAI API (deployment_config / LLMServingArgs, e.g. api_key)"
            )
        if key in engine_fields:
            engine[key] = value
        elif key in frontend_fields:
            frontend[key] = value
        else:
            raise ConfigError(
                f"engine_kwargs[{key!r}] is not an argument of vLLM's engine (AsyncEngineArgs) or of its OpenAI "
                "layer (FrontendArgs); see `vllm serve --help`"
            )
    engine["tensor_parallel_size"] = config.tensor_parallel_size
    if config.log_engine_metrics and engine.get("disable_log_stats"):
        raise ConfigError(
            "engine_kwargs['disable_log_stats']=True contradicts log_engine_metrics=True (engine metrics need "
            "vLLM's stats); set log_engine_metrics=False instead"
        )
    engine.setdefault("disable_log_stats", not config.log_engine_metrics)
    return engine, frontend
