"""The OpenAI semantics of a model on the embedded engine: prompts -> sequences -> response dicts.

`EmbeddedBackend` is plain Python (no Serve): the `LLMServer` replica wraps it (see base.py for the
backend interface), and benchmarks call it directly to measure the engine without HTTP. Requests arrive
as JSON dicts and are validated with tpuray's OpenAI protocol (openai/protocol.py); prompt length is checked against
max_model_len before any sequence is queued. (A vLLM model uses vLLM's own OpenAI layer instead:
vllm.py.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from tpuray.serve.llm.backends.base import EngineBackend, warm_up_error
from tpuray.serve.llm.backends.sampling import sampling_params
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine
from tpuray.serve.llm.generation import SamplingParams, TemplateError
from tpuray.serve.llm.openai.checks import check_body, parse_for_embedded
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.logprobs import LogprobFormatter, TextOffsets
from tpuray.serve.llm.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    new_id,
    now,
    template_messages,
    usage,
)

logger = logging.getLogger(__name__)

OFF_LOOP_CHARS = 16_384  # texts longer than this are tokenized in a worker thread


class Job(NamedTuple):
    """One choice to generate: its choice index, prompt ids, sampling, the seed stream index, echoed text."""

    choice: int
    prompt_ids: list[int]
    params: SamplingParams
    seed_index: int
    echo: str = ""


class Choice(NamedTuple):
    """One generated choice (non-streamed)."""

    choice: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    prompt_tokens: int
    logprobs: tuple | list = ()  # TokenLogprobs of the generated tokens (when asked for)
    prompt_logprobs: list | None = None  # TokenLogprobs of prompt tokens 1.. (echo with logprobs)


class EmbeddedBackend(EngineBackend):
    # only a worker actor's death or a failover's end kills the engine: a new one can start in the replica
    restartable = True

    def __init__(self, config: LLMConfig, **engine_options: Any):
        self.config = config
        self.engine = EmbeddedEngine(config, **engine_options)
        self.created = now()
        self.formatter = LogprobFormatter(self.engine.tokenizer)

    async def start(self) -> None:
        """The engine is built in the constructor; prove it with a 1-token generation (base.py)."""
        try:
            async for _ in self.engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0)):
                pass
        except Exception as e:
            raise warm_up_error(self.config, "embedded", e) from e

    async def check_health(self) -> None:
        await self.engine.check_alive()

    def engine_error(self) -> BaseException | None:
        return self.engine.dead

    # -- requests (dicts) -------------------------------------------------------------------------------
    def _parse(self, endpoint: str, body: dict[str, Any]) -> Any:
        req = parse_for_embedded(endpoint, body)
        if getattr(req, "user", None):  # OpenAI's end-user id, for monitoring: it goes to the log
            logger.debug("%s request from user %r", self.model_id, req.user)
        return req

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        body = check_body(endpoint, body)
        if endpoint == "completions":
            return await self.completions(self._parse(endpoint, body))
        if endpoint == "chat":
            return await self.chat(self._parse(endpoint, body))
        if endpoint == "tokenize":
            return await self.tokenize(self._parse(endpoint, body))
        if endpoint == "detokenize":
            return self.detokenize(self._parse(endpoint, body))
        raise OpenAIError(
            f"model `{self.model_id}` does not support {endpoint}; it serves text generation", param="model"
        )

    async def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = check_body(endpoint, body)
        if endpoint == "completions":
            stream = self.completions_stream(self._parse(endpoint, body))
        elif endpoint == "chat":
            stream = self.chat_stream(self._parse(endpoint, body))
        else:
            yield await self.handle(endpoint, body)
            return
        async for chunk in stream:
            yield chunk

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize shape: {count, max_model_len, tokens, token_strs}."""
        self._check_model(req)
        if req.messages is not None:
            messages = template_messages(req.messages)
            chars = sum(len(m["content"]) for m in messages)
            ids = await self._off_loop(
                chars, self._template, messages, add_generation_prompt=req.add_generation_prompt
            )
        else:
            prompt = req.prompt or ""
            encode = self.engine.tokenizer.encode
            ids = await self._off_loop(len(prompt), encode, prompt, add_special_tokens=req.add_special_tokens)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize shape: {prompt}."""
        self._check_model(req)
        vocab = len(self.engine.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    # -- request -> sequences ---------------------------------------------------------------------------
    def _params(self, req, prompt_len: int, param: str, default_max: int | None) -> SamplingParams:
        return sampling_params(self.engine, req, prompt_len, param, default_max)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """No text longer than this fits in max_model_len tokens (a token is at most its longest piece)."""
        longest = max((len(piece) for piece in self.engine.tokenizer.get_vocab()), default=1)
        return self.max_model_len * max(longest, 1)

    def _bound(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit in max_model_len without tokenizing it."""
        if chars > self.max_prompt_chars:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the {param} has "
                f"{chars} characters, more than that many tokens can hold. Please reduce the length of the "
                f"{param}.",
                param=param,
                code="context_length_exceeded",
            )

    async def _off_loop(self, chars: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs): in a worker thread for long texts, so other requests keep being served."""
        if chars > OFF_LOOP_CHARS:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def _completion_jobs(self, req: CompletionRequest) -> list[Job]:
        jobs = []
        prompts = req.prompts()
        if not prompts:
            raise OpenAIError("prompt must not be empty", param="prompt")
        vocab = len(self.engine.tokenizer)
        for p_idx, prompt in enumerate(prompts):
            if isinstance(prompt, list) and len(prompt) < self.max_model_len:
                if any(not 0 <= t < vocab for t in prompt):
                    raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            if isinstance(prompt, str):
                self._bound(len(prompt), "prompt")
                ids = await self._off_loop(
                    len(prompt), self.engine.encode_prompt, prompt, req.add_special_tokens
                )
            else:
                ids = list(prompt)
            params = self._params(req, len(ids), "prompt", 16)
            echo = (
                (prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)) if req.echo else ""
            )
            for i in range(req.n):
                jobs.append(Job(p_idx * req.n + i, ids, params, i, echo))
        return jobs

    def _template(self, messages: list[dict[str, str]], **options: Any) -> list[int]:
        try:
            return self.engine.apply_chat_template(messages, **options)
        except TemplateError as e:
            raise OpenAIError(str(e), param=e.param) from None

    async def _chat_jobs(self, req: ChatCompletionRequest) -> list[Job]:
        messages = template_messages(req.messages)
        chars = sum(len(m["content"]) for m in messages)
        self._bound(chars, "messages")
        ids = await self._off_loop(
            chars,
            self._template,
            messages,
            add_generation_prompt=req.generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            template_kwargs=req.chat_template_kwargs,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        )
        params = self._params(req, len(ids), "messages", None)
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == req.reply_role() else ""  # vLLM's chat echo
        return [Job(i, ids, params, i, echo) for i in range(req.n)]

    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_id:
            raise OpenAIError(
                f"The model `{req.model}` does not exist.", 404, param="model", code="model_not_found"
            )

    # -- non-streamed -------------------------------------------------------------------------------------
    async def _run_all(self, jobs: list[Job]) -> tuple[list[Choice], int, int]:
        async def run(job: Job) -> Choice:
            text, reason, n_out, lps, prompt_lps = job.echo, None, 0, [], None
            async for out in self.engine.generate(job.prompt_ids, job.params, job.seed_index):
                text += out.text
                lps += out.logprobs
                if out.prompt_logprobs is not None:
                    prompt_lps = out.prompt_logprobs
                reason, n_out = out.finish_reason, out.completion_tokens
            return Choice(job.choice, text, reason, n_out, len(job.prompt_ids), lps, prompt_lps)

        results = await asyncio.gather(*(run(j) for j in jobs))
        completion_tokens = sum(c.completion_tokens for c in results)
        return sorted(results, key=lambda c: c.choice), _prompt_tokens(jobs), completion_tokens

    def _completion_logprobs(self, req: CompletionRequest, job: Job, records, prompt_records, offsets=None):
        if req.logprobs is None:
            return None, offsets
        prompt = job.prompt_ids if req.echo and prompt_records is not None else None
        return self.formatter.completion(records, offsets, prompt, prompt_records)

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        self._check_model(req)
        jobs = await self._completion_jobs(req)
        results, pt, ct = await self._run_all(jobs)
        choices = []
        for c in results:
            lp, _ = self._completion_logprobs(req, jobs[c.choice], c.logprobs, c.prompt_logprobs)
            choices.append(
                {"index": c.choice, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            )
        return {
            "id": _response_id("cmpl", req),
            "object": "text_completion",
            "created": now(),
            "model": self.model_id,
            "choices": choices,
            "usage": usage(pt, ct),
        }

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        self._check_model(req)
        results, pt, ct = await self._run_all(await self._chat_jobs(req))
        choices = [
            {
                "index": c.choice,
                "message": {"role": req.reply_role(), "content": c.text},
                "logprobs": self.formatter.chat(c.logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in results
        ]
        return {
            "id": _response_id("chatcmpl", req),
            "object": "chat.completion",
            "created": now(),
            "model": self.model_id,
            "choices": choices,
            "usage": usage(pt, ct),
        }

    # -- streamed -----------------------------------------------------------------------------------------
    async def _stream_all(self, jobs: list[Job]) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, SeqOutput) from all jobs as they arrive; (-1, (prompt, completion)) at the end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async for out in self.engine.generate(job.prompt_ids, job.params, job.seed_index):
                    await queue.put((job.choice, out))
            except Exception as e:
                await queue.put((job.choice, e))

        tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
        done, completion = 0, 0
        try:
            while done < len(jobs):
                index, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finished:
                    done += 1
                    completion += out.completion_tokens
                yield index, out
        finally:
            for t in tasks:
                t.cancel()
        yield -1, (_prompt_tokens(jobs), completion)

    def _chunk(self, req, base: dict, choice: dict, out: Any, jobs: list[Job], sent: dict[int, int]) -> dict:
        """One stream chunk for `choice`; with stream_options.continuous_usage_stats, usage so far too."""
        sent[choice["index"]] = out.completion_tokens
        chunk = {**base, "choices": [{**choice, "finish_reason": out.finish_reason}]}
        opts = req.stream_options
        if opts and opts.include_usage and opts.continuous_usage_stats:
            chunk["usage"] = usage(_prompt_tokens(jobs), sum(sent.values()))
        return chunk

    async def completions_stream(self, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        self._check_model(req)
        jobs = await self._completion_jobs(req)  # raises before the first chunk
        base = {
            "id": _response_id("cmpl", req),
            "object": "text_completion",
            "created": now(),
            "model": self.model_id,
        }
        echoed: set[int] = set()
        offsets: dict[int, TextOffsets | None] = {j.choice: None for j in jobs}
        sent: dict[int, int] = {}
        async for index, out in self._stream_all(jobs):
            if index < 0:
                if req.stream_options and req.stream_options.include_usage:
                    yield {**base, "choices": [], "usage": usage(*out)}
                return
            text = out.text
            if index not in echoed:
                echoed.add(index)
                text = jobs[index].echo + text
            lp, offsets[index] = self._completion_logprobs(
                req, jobs[index], out.logprobs, out.prompt_logprobs, offsets[index]
            )
            yield self._chunk(req, base, {"index": index, "text": text, "logprobs": lp}, out, jobs, sent)

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        self._check_model(req)
        jobs = await self._chat_jobs(req)
        base = {
            "id": _response_id("chatcmpl", req),
            "object": "chat.completion.chunk",
            "created": now(),
            "model": self.model_id,
        }
        for i in range(req.n):
            delta = {"role": req.reply_role(), "content": ""}
            yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
        for job in jobs:  # echo: the last message's content first, as vLLM streams it
            if job.echo:
                delta = {"content": job.echo}
                choice = {"index": job.choice, "delta": delta, "logprobs": None, "finish_reason": None}
                yield {**base, "choices": [choice]}
        sent: dict[int, int] = {}
        async for index, out in self._stream_all(jobs):
            if index < 0:
                if req.stream_options and req.stream_options.include_usage:
                    yield {**base, "choices": [], "usage": usage(*out)}
                return
            delta = {"content": out.text} if out.text else {}
            lp = self.formatter.chat(out.logprobs) if req.logprobs else None
            yield self._chunk(req, base, {"index": index, "delta": delta, "logprobs": lp}, out, jobs, sent)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _prompt_tokens(jobs: list[Job]) -> int:
    """Prompt tokens of a request: each distinct prompt counted once, like OpenAI with n > 1."""
    return sum(len(ids) for ids in {id(j.prompt_ids): j.prompt_ids for j in jobs}.values())


def _response_id(prefix: str, req: CompletionRequest | ChatCompletionRequest) -> str:
    """vLLM's response id: <prefix>-<request_id> when the request names one, else a random one."""
    return f"{prefix}-{req.request_id}" if req.request_id else new_id(prefix)
