"""What an OpenAI request asks the embedded engine to sample with: one prompt's `SamplingParams`.

The request was checked when it was parsed (openai/checks.py); what needs the model is checked here,
through checks.py's functions: the prompt fits max_model_len, logit_bias, stop_token_ids and
allowed_token_ids name tokens of its vocabulary, min_tokens <= max_tokens, and a response_format schema
compiles to a grammar. Each failure is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from tpuray.serve.llm.generation import SamplingParams
from tpuray.serve.llm.openai.checks import (
    check_min_tokens,
    check_prompt_fits,
    check_token_ids,
    logit_bias_ids,
)
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import ChatCompletionRequest, CompletionRequest


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


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(top-n logprobs per generated token, the same per prompt token) a request asks for."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None, None
    return req.logprobs, req.logprobs if req.echo and req.logprobs is not None else None


def sampling_params(
    engine: Any,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    param: str,
    default_max: int | None,
) -> SamplingParams:
    """SamplingParams of one prompt of `req` (`param` names the prompt field in errors)."""
    mml, vocab = engine.max_model_len, engine.vocab_size
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    check_prompt_fits(prompt_len, max_tokens, mml, param)
    if max_tokens is None:
        max_tokens = min(default_max or mml, mml - prompt_len)
    check_min_tokens(req.min_tokens, max_tokens)
    logprobs, prompt_logprobs = _logprobs(req)
    allowed = req.allowed_token_ids
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
        logit_bias=logit_bias_ids(req.logit_bias, vocab),
        stop_token_ids=check_token_ids(list(req.stop_token_ids or []), vocab, "stop_token_ids"),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        allowed_token_ids=check_token_ids(allowed, vocab, "allowed_token_ids") if allowed else None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=_grammar(engine, req),
    )
