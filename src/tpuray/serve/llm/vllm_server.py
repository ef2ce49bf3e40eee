"""The OpenAI semantics of a vLLM-served model: vLLM's own serving layer, behind tpuray's routes.

`VLLMServer` builds vLLM's OpenAI serving objects (`init_app_state`, the code behind `vllm serve`) on the
engine, so everything vLLM supports passes through unchanged: logprobs / top_logprobs, echo, top_k,
min_p, penalties, logit_bias, n, seed, stop, response_format (json_object, json_schema), tools /
tool_choice (parser from engine_kwargs), stream_options, /tokenize, /detokenize, and vLLM's request
validation and errors. tpuray keeps auth, routing and the Serve layout; requests arrive as JSON dicts and
are parsed by vLLM's protocol classes.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.vllm_engine import VLLMEngine
from tpuray.serve.llm.protocol import OpenAIError, now, parse_request
from tpuray.serve.llm.replica import EngineBackend

DONE = "data: [DONE]\n\n"


def _error(err: Any) -> OpenAIError:
    """vLLM's ErrorResponse -> OpenAIError (same fields; `code` is vLLM's HTTP status)."""
    info = err.error
    status = int(info.code) if str(info.code).isdigit() else 400
    return OpenAIError(info.message, status, type=info.type, param=info.param)


class VLLMServer(EngineBackend):
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
        try:
            return await method(parse_request(cls, body), None)
        except (ValueError, VLLMClientError) as e:  # vLLM's request validation (as `vllm serve` answers it)
            raise _error(serving.create_error_response(e)) from None

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed request: the response dict, or OpenAIError raised."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self._call(endpoint, body)
        if isinstance(result, ErrorResponse):
            raise _error(result)
        if isinstance(result, AsyncIterator):  # stream=true reached the non-streamed path
            raise OpenAIError("stream must be true for a streamed response", param="stream")
        return result.model_dump(exclude_unset=False)

    async def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[str | dict]:
        """A streamed request: vLLM's SSE events (strings, without the final [DONE]); OpenAIError raised
        before the first event when vLLM refuses the request."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self._call(endpoint, body)
        if isinstance(result, ErrorResponse):
            raise _error(result)
        if not isinstance(result, AsyncIterator):  # e.g. /tokenize, or stream=false: one JSON body
            yield result.model_dump()
            return
        async for event in result:
            if event != DONE:
                yield event

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        self.engine.shutdown()
