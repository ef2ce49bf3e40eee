"""The OpenAI semantics of one served model, over an engine: prompts -> sequences -> response dicts.

`ModelServer` is plain Python (no Serve): the `LLMServer` deployment wraps it, and benchmarks call it
directly to measure the engine without HTTP. Prompt length is checked against max_model_len here, before
any sequence is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine import create_engine
from tpuray.serve.llm.engine.sampling import SamplingParams
from tpuray.serve.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    model_card,
    new_id,
    now,
    usage,
)


class ModelServer:
    def __init__(self, config: LLMConfig, **engine_options: Any):
        self.config = config
        self.engine = create_engine(config, **engine_options)
        self.created = now()

    @property
    def model_id(self) -> str:
        return self.config.model_id

    def card(self) -> dict[str, Any]:
        return model_card(self.model_id, self.created, self.engine.max_model_len)

    # -- request -> sequences ---------------------------------------------------------------------------
    def _params(self, req, prompt_len: int, param: str, default_max: int | None) -> SamplingParams:
        mml = self.engine.max_model_len
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
        return SamplingParams(max_tokens, req.temperature, req.top_p, req.stop_list(), req.seed)

    def _completion_jobs(
        self, req: CompletionRequest
    ) -> list[tuple[int, list[int], SamplingParams, int, str]]:
        jobs = []
        prompts = req.prompts()
        if not prompts:
            raise OpenAIError("prompt must not be empty", param="prompt")
        for p_idx, prompt in enumerate(prompts):
            if isinstance(prompt, list) and any(not 0 <= t < len(self.engine.tokenizer) for t in prompt):
                raise OpenAIError(
                    f"prompt token ids must be in [0, {len(self.engine.tokenizer)})", param="prompt"
                )
            ids = self.engine.encode_prompt(prompt)
            params = self._params(req, len(ids), "prompt", 16)
            echo = (
                (prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)) if req.echo else ""
            )
            for i in range(req.n):
                jobs.append((p_idx * req.n + i, ids, params, i, echo))
        return jobs

    def _chat_jobs(self, req: ChatCompletionRequest) -> list[tuple[int, list[int], SamplingParams, int, str]]:
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages
        ]
        ids = self.engine.apply_chat_template(messages)
        params = self._params(req, len(ids), "messages", None)
        return [(i, ids, params, i, "") for i in range(req.n)]

    def _check_model(self, req) -> None:
        if req.model != self.model_id:
            raise OpenAIError(
                f"The model `{req.model}` does not exist.", 404, param="model", code="model_not_found"
            )

    # -- non-streamed -------------------------------------------------------------------------------------
    async def _run_all(self, jobs) -> tuple[list[dict], int, int]:
        async def run(job):
            index, ids, params, seed_index, echo = job
            text, reason, n_out = echo, None, 0
            async for out in self.engine.generate(ids, params, seed_index):
                text += out.text
                reason, n_out = out.finish_reason, out.completion_tokens
            return index, text, reason, n_out, len(ids)

        results = await asyncio.gather(*(run(j) for j in jobs))
        prompt_tokens = 0
        seen: set[int] = set()
        for job, r in zip(jobs, results, strict=True):
            if id(job[1]) not in seen:  # count each distinct prompt once, like OpenAI with n > 1
                seen.add(id(job[1]))
                prompt_tokens += r[4]
        completion_tokens = sum(r[3] for r in results)
        return sorted(results), prompt_tokens, completion_tokens

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        self._check_model(req)
        results, pt, ct = await self._run_all(self._completion_jobs(req))
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f} for i, t, f, _, _ in results]
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": self.model_id,
            "choices": choices,
            "usage": usage(pt, ct),
        }

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        self._check_model(req)
        results, pt, ct = await self._run_all(self._chat_jobs(req))
        choices = [
            {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": f}
            for i, t, f, _, _ in results
        ]
        return {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": self.model_id,
            "choices": choices,
            "usage": usage(pt, ct),
        }

    # -- streamed -----------------------------------------------------------------------------------------
    async def _stream_all(self, jobs) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, SeqOutput) from all jobs as they arrive; (-1, (prompt, completion)) at the end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job):
            index, ids, params, seed_index, _ = job
            try:
                async for out in self.engine.generate(ids, params, seed_index):
                    await queue.put((index, out))
            except Exception as e:
                await queue.put((index, e))

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
        prompt = sum(len(ids) for ids in {id(j[1]): j[1] for j in jobs}.values())
        yield -1, (prompt, completion)

    async def completions_stream(self, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        self._check_model(req)
        jobs = self._completion_jobs(req)  # raises before the first chunk
        base = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": self.model_id}
        echoed: set[int] = set()
        async for index, out in self._stream_all(jobs):
            if index < 0:
                if (req.stream_options or {}).get("include_usage"):
                    yield {**base, "choices": [], "usage": usage(*out)}
                return
            text = out.text
            if index not in echoed:
                echoed.add(index)
                text = jobs[index][4] + text
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
            yield {**base, "choices": [choice]}

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        self._check_model(req)
        jobs = self._chat_jobs(req)
        base = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": now(),
            "model": self.model_id,
        }
        for i in range(req.n):
            delta = {"role": "assistant", "content": ""}
            yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
        async for index, out in self._stream_all(jobs):
            if index < 0:
                if (req.stream_options or {}).get("include_usage"):
                    yield {**base, "choices": [], "usage": usage(*out)}
                return
            delta = {"content": out.text} if out.text else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
            yield {**base, "choices": [choice]}

    def shutdown(self) -> None:
        self.engine.shutdown()
