"""The OpenAI semantics of a vLLM-served model: vLLM's own serving layer, behind tpuray's routes.

`VLLMBackend` builds vLLM's OpenAI serving objects (`init_app_state`, the code behind `vllm serve`) on the
engine, so everything vLLM supports passes through unchanged: logprobs / top_logprobs, echo, top_k,
min_p, penalties, logit_bias, n, seed, stop, response_format (json_object, json_schema), tools /
tool_choice (parser from engine_kwargs), stream_options, /tokenize, /detokenize, and vLLM's request
validation and errors. tpuray keeps auth, routing and the Serve layout; requests arrive as JSON dicts and
are parsed by vLLM's protocol classes.

Nothing is silently ignored on this path either: before vLLM parses a request, tpuray checks it
(openai/checks.py, `check_for_vllm`: strict types for the OpenAI fields, whose ranges are vLLM's own, and
a 400 for each field vLLM would drop); a vLLM error that names no `param` gets the request field its
message names; a request the platform refuses when vLLM adds it (vLLM-TorchTPU: "JAX does not support
per-request seed.", a ValueError that vLLM's AsyncLLM wraps in EngineGenerateError, a 500 under `vllm
serve`) is a 400 naming the field, as vLLM's own validation errors are.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.backends.base import EngineBackend, warm_up_error
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.vllm.engine import VLLMEngine
from tpuray.serve.llm.openai.checks import check_body, check_for_vllm
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import now, parse_request

DONE = "data: [DONE]\n\n"


def _named_param(message: str, body: dict[str, Any]) -> str | None:
    """The request field an error message names (longest first: top_logprobs before logprobs)."""
    words = set(re.findall(r"[A-Za-z_]+", message))
    return next((k for k in sorted(body, key=len, reverse=True) if k in words), None)


def _error(err: Any, body: dict[str, Any]) -> OpenAIError:
    """vLLM's ErrorResponse -> OpenAIError (same fields; `code` is vLLM's HTTP status)."""
    info = err.error
    status = int(info.code) if str(info.code).isdigit() else 400
    param = info.param or (_named_param(info.message, body) if status == 400 else None)
    return OpenAIError(info.message, status, type=info.type, param=param)


def _prompt_only(endpoint: str, body: dict[str, Any]) -> bool:
    """A completion with echo and max_tokens 0: the prompt alone (vLLM's scoring mode)."""
    return endpoint == "completions" and body.get("echo") is True and body.get("max_tokens") == 0


def _no_completion_tokens(response: dict[str, Any]) -> None:
    """vLLM counts the one token it samples, and drops, for echo with max_tokens 0; none is returned, so
    usage counts none (as the embedded engine does)."""
    usage = response.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens"):
        usage["total_tokens"] -= usage["completion_tokens"]
        usage["completion_tokens"] = 0


class VLLMBackend(EngineBackend):
    """One model on vLLM: the engine plus vLLM's OpenAI serving layer."""

    def __init__(self, config: LLMConfig, **engine_options: Any) -> None:
        self.config = config
        self.engine = VLLMEngine(config, **engine_options)
        self.created = now()
        self.state: Any = None

    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.entrypoints.openai.api_server import init_app_state

        frontend = FrontendArgs(**self.engine.frontend_args)
        engine_args = dict(vars(self.engine.args))
        for (
            key,
            value,
        ) in engine_args.items():  # config dicts (e.g. structured_outputs_config) as vLLM built them
            if isinstance(value, dict) and hasattr(self.engine.vllm_config, key):
                engine_args[key] = getattr(self.engine.vllm_config, key)
        args = argparse.Namespace(**(vars(frontend) | engine_args))  # flat, as vLLM's own CLI parses it
        state = State()
        tasks = await self.engine.client.get_supported_tasks()
        await init_app_state(self.engine.client, state, args, supported_tasks=tasks)
        self.state = state
        await self.warm_up()

    async def warm_up(self) -> None:
        """One 1-token generation before the replica reports ready: a model vLLM's engine core cannot
        run (e.g. an attention configuration its kernels refuse) kills it here, not at the first request."""
        from vllm import SamplingParams

        try:
            async for _ in self.engine.client.generate(
                {"prompt_token_ids": [0]}, SamplingParams(max_tokens=1, temperature=0.0), f"warm-up-{now()}"
            ):
                pass
        except Exception as e:
            raise warm_up_error(self.config, "vLLM", e) from e

    # -- requests -------------------------------------------------------------------------------------
    def _serving(self, name: str, what: str) -> Any:
        serving = getattr(self.state, name, None)
        if serving is None:
            raise OpenAIError(f"model `{self.model_id}` does not support {what}", param="model")
        return serving

    async def _call(self, endpoint: str, body: dict[str, Any]) -> Any:
        """vLLM's result for one request: a response model, an ErrorResponse or an SSE string stream."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.tokenize import protocol as tok
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineGenerateError

        cls: Any
        method: Any
        if endpoint == "completions":
            serving = self._serving("openai_serving_completion", "completions")
            cls, method = CompletionRequest, serving.create_completion
        elif endpoint == "chat":
            serving = self._serving("openai_serving_chat", "chat completions")
            cls, method = ChatCompletionRequest, serving.create_chat_completion
        elif endpoint == "tokenize":
            serving = self._serving("serving_tokenization", "/tokenize")
            cls = tok.TokenizeChatRequest if "messages" in body else tok.TokenizeCompletionRequest
            method = serving.create_tokenize
        elif endpoint == "detokenize":
            serving = self._serving("serving_tokenization", "/detokenize")
            cls, method = tok.DetokenizeRequest, serving.create_detokenize
        else:
            raise OpenAIError(
                f"model `{self.model_id}` does not serve {endpoint}; it serves text generation", param="model"
            )
        body = check_body(endpoint, body)
        check_for_vllm(endpoint, body)
        try:
            return await method(parse_request(cls, body), None)
        except OpenAIError as e:  # vLLM's pydantic checks: name the field a model-level error talks about
            e.param = e.param or _named_param(e.message, body)
            raise
        except (ValueError, VLLMClientError) as e:  # vLLM's request validation (as `vllm serve` answers it)
            raise _error(serving.create_error_response(e), body) from None
        except EngineGenerateError as e:  # a platform's refusal (vLLM-TorchTPU: a seed), wrapped by AsyncLLM
            if not isinstance(e.__cause__, ValueError):
                raise
            raise _error(serving.create_error_response(e.__cause__), body) from None

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed request: the response dict, or OpenAIError raised."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self._call(endpoint, body)
        if isinstance(result, ErrorResponse):
            raise _error(result, body)
        if isinstance(result, AsyncIterator):  # stream=true reached the non-streamed path
            raise OpenAIError("stream must be true for a streamed response", param="stream")
        response = result.model_dump(exclude_unset=False)
        if _prompt_only(endpoint, body):
            _no_completion_tokens(response)
        return response

    async def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[str | dict]:
        """A streamed request: vLLM's SSE events (strings, without the final [DONE]); OpenAIError raised
        before the first event when vLLM refuses the request."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self._call(endpoint, body)
        if isinstance(result, ErrorResponse):
            raise _error(result, body)
        if not isinstance(result, AsyncIterator):  # e.g. /tokenize, or stream=false: one JSON body
            yield result.model_dump()
            return
        prompt_only = _prompt_only(endpoint, body)
        async for event in result:
            if event == DONE:
                continue
            dead = self.engine_error() if event.startswith('data: {"error"') else None
            if dead is not None:  # vLLM's own 500 event: the replica answers its engine_dead_error
                raise dead
            if prompt_only and isinstance(event, str) and '"usage"' in event:
                data = json.loads(event.removeprefix("data: "))
                _no_completion_tokens(data)
                event = f"data: {json.dumps(data)}\n\n"
            yield event

    async def check_health(self) -> None:
        await self.engine.check_health()

    def engine_error(self) -> BaseException | None:
        return self.engine.engine_error()

    @property
    def restartable(self) -> bool:
        """vLLM's engine core in a child process: yes; in the replica's own (VLLM_ENABLE_V1_MULTIPROCESSING=0,
        a one-chip TPU VM) the dead engine's state and chip stay in the process: Serve replaces it."""
        return not self.engine.in_process

    def shutdown(self) -> None:
        self.engine.shutdown()
