"""The OpenAI app on Ray Serve over the emulated cluster: a tiny Llama with TP=4 on one v6e 2x2 slice
(one engine worker per emulated chip, tpu_dist all_reduce) plus MiniLM embeddings, driven with the real
`openai` client (sync, async, streaming) and raw HTTP for bad input. One Serve app for the whole module."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re

import httpx
import openai
import pytest
from _configs import MAX_MODEL_LEN, tiny_tp4_config
from _vllm_fields import VLLM_REFUSED

from _util import live_placement_groups, new_placement_groups

API_KEY = "test-key"
EMBED_ID = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(serve_url, tiny_model_dir):
    """Both apps of the module, each on its own 2x2 slice: "tpuray-llm" (router + the tiny model + MiniLM,
    at /) and "tpuray-single" (the one-model app, at /single, see `single`). Deployed in one call, so
    their replicas start at the same time (one wait instead of two)."""
    import ray
    from ray import serve

    from tpuray.serve.llm import LLMServingArgs, build_openai_app, minilm_config

    before = set(live_placement_groups())
    config = tiny_tp4_config(tiny_model_dir)  # workers launch ahead (the default; off: /single)
    # the one-model app: one engine worker holding its slice's 4 chips (one process to start, not 4),
    # stepping synchronously (the engine's other path), recording no engine metrics
    one_worker = dataclasses.replace(
        tiny_tp4_config(tiny_model_dir, chips_per_worker=4, async_scheduling=False), log_engine_metrics=False
    )
    single_args = LLMServingArgs(llm_configs=[one_worker], api_key="")
    assert single_args.single_deployment
    try:
        app = build_openai_app(LLMServingArgs(llm_configs=[config, minilm_config()], api_key=API_KEY))
        serve.run_many(
            [
                serve.RunTarget(app, name="tpuray-llm", route_prefix="/"),
                serve.RunTarget(build_openai_app(single_args), name="tpuray-single", route_prefix="/single"),
            ]
        )
        yield serve_url
    finally:
        serve.delete("tpuray-single")
        serve.delete("tpuray-llm")
        assert not new_placement_groups(before), "an app's slice placement group was not released"
        assert ray.is_initialized()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models_and_replica_layout(client, server):
    from ray import serve

    ids = sorted(m.id for m in client.models.list())
    assert ids == sorted(["tiny", EMBED_ID])
    # each model's state, asked of its own deployment through the router
    cards = httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert {c["id"]: c["status"] for c in cards.json()["data"]} == {"tiny": "serving", EMBED_ID: "serving"}
    health = httpx.get(server + "/health", timeout=30)
    assert health.status_code == 200, health.text
    assert health.json() == {"status": "ok", "models": {"tiny": "serving", EMBED_ID: "serving"}}
    info = serve.get_deployment_handle("LLMServer:tiny", app_name="tpuray-llm").describe.remote().result()
    assert info["tensor_parallel_size"] == 4 and info["emulated"] is True and info["async_scheduling"]
    assert [w["rank"] for w in info["workers"]] == [0, 1, 2, 3]
    assert len({w["pid"] for w in info["workers"]}) == 4
    assert all(w["device"].startswith("tpu") for w in info["workers"])
    assert "v6e-4" in info["slice"]


def test_tensor_parallel_matches_single_chip(client, tiny_model_dir):
    """Greedy text from the 4-way sharded engine (async scheduling) equals the unsharded engine in this
    process (synchronous)."""
    from tpuray.serve.llm import LLMConfig
    from tpuray.serve.llm.backends.embedded import EmbeddedBackend
    from tpuray.serve.llm.openai.protocol import CompletionRequest

    local = EmbeddedBackend(
        LLMConfig(
            model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
            llm_engine="embedded",
            engine_kwargs={"max_model_len": MAX_MODEL_LEN},
        )
    )
    try:
        for prompt in ["Hello world", "Tensor parallelism splits attention heads"]:
            req = CompletionRequest(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            ref = asyncio.run(local.completions(req))["choices"][0]["text"]
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            assert got.choices[0].text == ref
    finally:
        local.shutdown()


def test_completions_and_chat(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=3,
        seed=11,
        temperature=1.0,
    )
    assert [ch.index for ch in c.choices] == [0, 1, 2] and c.usage.completion_tokens <= 18
    again = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=3,
        seed=11,
        temperature=1.0,
    )
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in c.choices]
    multi = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, n=2, temperature=0)
    assert len(multi.choices) == 4


def test_stop_string(client):
    full = (
        client.completions.create(model="tiny", prompt="Hello", max_tokens=30, temperature=0).choices[0].text
    )
    stop = full[5:7]
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]


def test_streaming(client, server):
    full = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream"}], max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "stream"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    # raw SSE framing ends with [DONE]
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_async_client(server):
    async def go():
        async with openai.AsyncOpenAI(
            base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as c:
            rs = await asyncio.gather(
                *(
                    c.completions.create(model="tiny", prompt=f"p{i}", max_tokens=4, temperature=0)
                    for i in range(8)
                )
            )
            stream = await c.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=True)
            parts = [ch async for ch in stream]
            return rs, parts

    rs, parts = asyncio.run(go())
    assert all(r.choices[0].finish_reason for r in rs)
    assert parts[-1].choices[0].finish_reason in ("length", "stop")


def test_embeddings(client):
    e = client.embeddings.create(
        model=EMBED_ID,
        input=["A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock markets fell today."],
    )
    vecs = [d.embedding for d in e.data]
    assert len(vecs) == 3 and len(vecs[0]) == 384 and e.usage.prompt_tokens > 0

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert math.isclose(cos(vecs[0], vecs[0]), 1.0, rel_tol=1e-4)
    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", '{"model": "tiny"}', 400, "prompt"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": []}', 400, "messages"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}',
            400,
            "messages.0.role",
        ),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": "lots"}', 400, "max_tokens"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": 9}', 400, "temperature"),
        ("/v1/completions", '{"model": "nope", "prompt": "x"}', 404, "model"),
        ("/v1/completions", '{"model": "tiny", "prompt": []}', 400, "prompt"),
        ("/v1/completions", '["not", "an", "object"]', 400, None),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": 1000}', 400, "prompt"),
        ("/v1/embeddings", '{"model": "tiny", "input": "x"}', 400, "model"),
        (
            "/v1/completions",
            '{"model": "sentence-transformers/all-MiniLM-L6-v2", "prompt": "x"}',
            400,
            "model",
        ),
    ],
)
def test_errors_use_openai_format(server, path, body, status, param):
    r = httpx.post(
        server + path,
        content=body,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_prompt_over_max_model_len(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * (MAX_MODEL_LEN * 2), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN * 2}], stream=True
        )


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server + "/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()


def test_500_concurrent_requests_lose_none(server):
    async def go():
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        async with httpx.AsyncClient(limits=limits, timeout=600) as http:
            c = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, http_client=http)
            return await asyncio.gather(
                *(
                    c.completions.create(model="tiny", prompt=f"load {i}", max_tokens=3, seed=i)
                    for i in range(500)
                ),
                return_exceptions=True,
            )

    results = asyncio.run(go())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of 500 failed, e.g. {failures[0]!r}"
    assert all(
        r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 0 for r in results
    )
    assert len({r.id for r in results}) == 500


@pytest.fixture(scope="module")
def single(server):
    """The one-model app (one deployment: routes and engine in the replica) on the other 2x2 slice,
    deployed (and deleted, its placement group checked) with the module's other app by `server`."""
    return server + "/single"


def test_single_model_app_is_one_deployment(single, client):
    from ray import serve

    assert list(serve.status().applications["tpuray-single"].deployments) == ["LLMServer:tiny"]
    info = serve.get_deployment_handle("LLMServer:tiny", app_name="tpuray-single").describe.remote().result()
    assert info["tensor_parallel_size"] == 1 and info["emulated"] is True and "v6e-4" in info["slice"]
    assert len(info["workers"]) == 1 and not info["async_scheduling"]
    c = openai.OpenAI(base_url=single + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in c.models.list()] == ["tiny"]
    # the same greedy text as the two-hop app (router -> LLMServer deployment) serving the same model
    kw = dict(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
    text = c.completions.create(**kw).choices[0].text
    assert text == client.completions.create(**kw).choices[0].text
    chat = dict(model="tiny", messages=[{"role": "user", "content": "stream"}], max_tokens=12, temperature=0)
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(**chat, stream=True)
        if ch.choices
    )
    assert streamed == c.chat.completions.create(**chat).choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # an engine error before the first chunk: JSON, not SSE
        c.completions.create(model="tiny", prompt="word " * MAX_MODEL_LEN * 2, max_tokens=1, stream=True)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x", max_tokens=1)


C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
# (path, request fields on top of a valid request, the param the 400 must name)
BAD_REQUESTS = [
    (C, {"logprobs": -3}, "logprobs"),
    (C, {"logprobs": 21}, "logprobs"),
    (C, {"logprobs": 1.5}, "logprobs"),
    (C, {"logprobs": True}, "logprobs"),
    (C, {"echo": "yes"}, "echo"),
    (C, {"stream": "maybe"}, "stream"),
    (C, {"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    (C, {"stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus"),
    (C, {"n": 0.5}, "n"),
    (C, {"n": 0}, "n"),
    (C, {"n": 129}, "n"),
    (C, {"n": "2"}, "n"),
    (C, {"max_tokens": 0}, "max_tokens"),
    (C, {"max_tokens": 2.5}, "max_tokens"),
    (C, {"max_tokens": True}, "max_tokens"),
    (C, {"temperature": -0.1}, "temperature"),
    (C, {"temperature": "hot"}, "temperature"),
    (C, {"top_p": 0}, "top_p"),
    (C, {"top_p": 1.5}, "top_p"),
    (C, {"top_k": -2}, "top_k"),
    (C, {"top_k": 1.5}, "top_k"),
    (C, {"min_p": 1.5}, "min_p"),
    (C, {"min_p": -0.1}, "min_p"),
    (C, {"presence_penalty": 2.5}, "presence_penalty"),
    (C, {"presence_penalty": -3}, "presence_penalty"),
    (C, {"frequency_penalty": 9}, "frequency_penalty"),
    (C, {"repetition_penalty": 0}, "repetition_penalty"),
    (C, {"repetition_penalty": 3}, "repetition_penalty"),
    (C, {"logit_bias": {"5": 101}}, "logit_bias.5"),
    (C, {"logit_bias": {"5": "up"}}, "logit_bias.5"),
    (C, {"logit_bias": {"five": 1}}, "logit_bias"),
    (C, {"logit_bias": {"999999": 1}}, "logit_bias"),
    (C, {"logit_bias": [1, 2]}, "logit_bias"),
    (C, {"stop_token_ids": [999999]}, "stop_token_ids"),
    (C, {"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    (C, {"stop": 5}, "stop"),
    (C, {"stop": [1, 2]}, "stop"),
    (C, {"seed": "x"}, "seed"),
    (C, {"seed": 1.5}, "seed"),
    (C, {"suffix": "tail"}, "suffix"),
    (C, {"best_of": 3}, "best_of"),
    (C, {"best_of": 0}, "best_of"),
    (C, {"user": 5}, "user"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": [999999]}, "prompt"),
    (C, {"response_format": {"type": "xml"}}, "response_format.type"),
    (C, {"response_format": {"type": "json_schema"}}, "response_format"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}}, "response_format.json_schema.name"),
    (C, {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    (C, {"response_format": "json"}, "response_format"),
    (CH, {"logprobs": "yes"}, "logprobs"),
    (CH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CH, {"top_logprobs": 2}, "top_logprobs"),
    (CH, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CH, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CH, {"tool_choice": "required"}, "tool_choice"),
    (CH, {"parallel_tool_calls": True}, "parallel_tool_calls"),
    (CH, {"functions": [{"name": "f"}]}, "functions"),
    (CH, {"function_call": "auto"}, "function_call"),
    (CH, {"modalities": ["text", "audio"]}, "modalities"),
    (CH, {"audio": {"voice": "alloy"}}, "audio"),
    (CH, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CH, {"reasoning_effort": "high"}, "reasoning_effort"),
    (CH, {"service_tier": "flex"}, "service_tier"),
    (CH, {"store": True}, "store"),
    (CH, {"metadata": {"k": "v"}}, "metadata"),
    (CH, {"web_search_options": {}}, "web_search_options"),
    (CH, {"verbosity": "low"}, "verbosity"),
    (CH, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content.0.type"),
    (CH, {"stream": 1}, "stream"),
    *[(path, {field: value}, field) for path, field, value in VLLM_REFUSED],  # vLLM-only fields
]  # fmt: skip


def test_bad_requests_are_400s_naming_the_param_and_the_server_keeps_serving(server):
    """Every field is either honoured or refused: wrong types, out-of-range values and fields this
    engine cannot honour each get a 400 naming the field."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert len(BAD_REQUESTS) >= 60
    with httpx.Client(base_url=server, headers=headers, timeout=60) as http:
        for path, extra, param in BAD_REQUESTS:
            valid = {
                "model": "tiny",
                "max_tokens": 2,
                **({"prompt": "x"} if path == C else {"messages": MSG}),
            }
            r = http.post(path, json={**valid, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())
        ok = http.post(C, json={"model": "tiny", "prompt": "x", "max_tokens": 2, "unknown_field": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_tp4_logprobs_equal_transformers(client, tiny_model_dir):
    """Logprobs from the 4-way sharded engine on the emulated slice equal transformers' log_softmax."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok("Hello world").input_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        for value in lp.token_logprobs:
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(ref.argmax())
            assert abs(value - ref[token].item()) < 1e-4
            ids.append(token)
    assert len(lp.token_logprobs) == 6


def test_log_engine_metrics_false_exports_no_engine_metrics(single, client):
    """LLMConfig(log_engine_metrics=False) (the one-model app's): its /metrics works and counts the
    request, but records no engine metric, while the other app's engine records them."""
    c = openai.OpenAI(base_url=single + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert (
        c.completions.create(
            model="tiny", prompt="Hello", max_tokens=3, temperature=0
        ).usage.completion_tokens
        == 3
    )
    quiet = _scrape(single)
    assert "http_requests_total" in quiet  # /metrics works and counts the request ...
    assert not [n for n in quiet if n.startswith("vllm:")], sorted(quiet)  # ... but no engine metric
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert "vllm:generation_tokens_total" in _scrape(single.removesuffix("/single"))


def _scrape(server: str) -> dict[str, dict]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _total(samples: dict[str, dict], name: str, **labels: str) -> float:
    return sum(
        v for k, v in samples.get(name, {}).items() if all(dict(k).get(a) == b for a, b in labels.items())
    )


def test_metrics_parse_and_counters_move(server, client):
    before = _scrape(server)
    client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, extra_body={"min_p": 0.0}
    )
    after = _scrape(server)
    m = {"model_name": "tiny"}
    assert (
        _total(after, "vllm:generation_tokens_total", **m)
        - _total(before, "vllm:generation_tokens_total", **m)
        >= 5
    )
    assert _total(after, "vllm:prompt_tokens_total", **m) > _total(before, "vllm:prompt_tokens_total", **m)
    assert _total(after, "vllm:time_to_first_token_seconds_count", **m) > _total(
        before, "vllm:time_to_first_token_seconds_count", **m
    )
    assert _total(after, "vllm:request_success_total", **m) > _total(
        before, "vllm:request_success_total", **m
    )
    ok = _total(after, "http_requests_total", handler="/v1/completions", status="200")
    assert ok > _total(before, "http_requests_total", handler="/v1/completions", status="200")
    assert ("vllm:kv_cache_usage_perc" in after) and ("vllm:num_requests_running" in after)


def test_vllm_bench_serve_measures_the_endpoint(single, tiny_model_dir):
    """vLLM's own benchmark client runs from the project's environment against a tpuray endpoint (the
    way docs/serve.md gives to benchmark one): every request answered."""
    import importlib.metadata
    import os
    import subprocess
    import sys

    assert importlib.metadata.version("vllm") == "0.29.0+cpu"  # what `vllm --version` prints
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    bench = subprocess.run(
        [vllm, "bench", "serve", "--backend", "openai", "--base-url", single, "--model", "tiny",
         "--tokenizer", tiny_model_dir, "--dataset-name", "random", "--random-input-len", "16",
         "--random-output-len", "8", "--num-prompts", "8", "--seed", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert "Successful requests:                     8" in bench.stdout, bench.stdout[-3000:]


def test_tpuray_status_names_the_holders_and_the_apps(single, server):
    """`tpuray status` names each busy slice's holder (the model it serves) and the Serve apps with their
    OpenAI endpoints."""
    import subprocess
    import sys

    import ray

    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, "-m", "tpuray.cli", "status", "--address", address],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if re.search(r" serve:tiny#[0-9a-f]{4}$", line)]
    assert len(rows) == 2 and all(" busy " in r for r in rows), out.stdout  # one slice per app
    assert f"tpuray-llm: RUNNING, {server}/v1 (OpenAI)" in out.stdout
    assert f"tpuray-single: RUNNING, {single}/v1 (OpenAI)" in out.stdout


def test_the_openapi_document_offers_the_served_models(server, single):
    """Schema-driven tools (schemathesis) send what /openapi.json offers: the served model ids as the
    `model` field's values, and realistic prompts, so that their requests reach the handlers."""
    for url, served in ((server, ["tiny", EMBED_ID]), (single, ["tiny"])):
        schemas = httpx.get(f"{url}/openapi.json", timeout=60).json()["components"]["schemas"]
        model = schemas["CompletionRequest"]["properties"]["model"]
        assert model["enum"] == served and model["examples"] == served[:1]
        assert schemas["TokenizeRequest"]["properties"]["model"]["anyOf"][0]["enum"] == served
        assert schemas["ChatCompletionRequest"]["properties"]["messages"]["examples"][0][0]["role"] == "user"
        assert schemas["CompletionRequest"]["properties"]["prompt"]["examples"] == ["Hello, my name is"]
