"""An OpenAI request (openai/protocol.py, already type-checked) -> the embedded engine's SamplingParams.

Checks what needs the model: the prompt fits max_model_len, logit_bias, stop_token_ids and
allowed_token_ids name tokens of its vocabulary, min_tokens <= max_tokens, a response_format schema
compiles to a grammar. Each failure is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from tpuray.serve.llm.generation import SamplingParams
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import ChatCompletionRequest, CompletionRequest


def _token_ids(engine: Any, ids: list[int], param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < engine.vocab_size]
    if bad:
        raise OpenAIError(
            f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {engine.vocab_size})", param=param
        )
    return ids


def _logit_bias(engine: Any, bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    try:
        ids = {int(k): v for k, v in bias.items()}
    except ValueError:
        raise OpenAIError(
            f"logit_bias keys must be token ids (integers as strings), got {sorted(bias)[:5]}",
            param="logit_bias",
        ) from None
    _token_ids(engine, list(ids), "logit_bias")
    return ids


def _grammar(engine: Any, req: CompletionRequest | ChatCompletionRequest) -> Any:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    from tpuray.serve.llm.engine.embedded.grammar import GrammarError

    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema else None
    if fmt.type == "json_schema" and not schema:
        raise OpenAIError("response_format.json_schema.schema is required", param="response_format")
    try:
        return engine.grammar(schema)
    except GrammarError as e:
        raise OpenAIError(
            f"response_format: the schema cannot be compiled: {e}", param="response_format"
        ) from None


def sampling_params(
    engine: Any,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    param: str,
    default_max: int | None,
) -> SamplingParams:
    """SamplingParams of one prompt of `req` (`param` names the prompt field in errors)."""
    mml = engine.max_model_len
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if prompt_len == 0:
        raise OpenAIError("the prompt is empty", param=param)
    if prompt_len >= mml or (max_tokens is not None and prompt_len + max_tokens > mml):
        asked = prompt_len + (max_tokens or 0)
        raise OpenAIError(
            f"This model's maximum context length is {mml} tokens. However, you requested {asked} tokens "
            f"({prompt_len} in the {param}, {max_tokens or 0} in the completion). Please reduce the length "
            f"of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max or mml, mml - prompt_len)
    if req.min_tokens > max_tokens:
        raise OpenAIError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.",
            param="min_tokens",
        )
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=req.stop_list(),
        seed=req.seed,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(engine, req.logit_bias),
        stop_token_ids=_token_ids(engine, list(req.stop_token_ids or []), "stop_token_ids"),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        allowed_token_ids=(
            _token_ids(engine, req.allowed_token_ids, "allowed_token_ids") if req.allowed_token_ids else None
        ),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=_grammar(engine, req),
    )
