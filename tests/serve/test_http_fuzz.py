"""The app's OpenAPI document describes the real request and response models, and the HTTP surface holds
under fuzzing driven by that document (issue 22, item 6), on both engines, in one app:
- "tiny-auto": the tiny model (head_dim 8) under llm_engine "auto": vLLM's CPU attention cannot run it, so
  the embedded engine serves it (issue 22, item 1: a live endpoint that answers, not a dead vLLM);
- "tiny-vllm": a head_dim 64 model on vLLM (CPU).
Every fuzzed request gets an answer below 500 within its timeout, a documented response (validated against
the document's schema with jsonschema), and each model answers a normal request afterwards.
TPURAY_FUZZ_EXAMPLES sets the examples per engine (default 200)."""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx
import jsonschema
import pytest
from _openapi_fuzz import request_bodies
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.slow  # ~2.5 min: make test-fast skips it, make test (CI) runs it

AUTO, VLLM = "tiny-auto", "tiny-vllm"
EXAMPLES = int(os.environ.get("TPURAY_FUZZ_EXAMPLES", "200"))
TIMEOUT_S = 120.0
POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
REQUEST_MODELS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}


@pytest.fixture(scope="module")
def app(serve_url, tiny_model_dir, tmp_path_factory):
    from ray import serve

    from tpuray.models import build_tiny_causal_lm
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    kwargs = {"max_model_len": 128, "max_num_seqs": 8, "dtype": "float32"}
    configs = [
        LLMConfig(
            model_loading_config={"model_id": AUTO, "model_source": tiny_model_dir},
            llm_engine="auto",
            engine_kwargs=kwargs,
        )
    ]
    if vllm_available():
        path = build_tiny_causal_lm(
            tmp_path_factory.mktemp("fuzz") / "hd64", hidden_size=128, num_attention_heads=2
        )
        configs.append(
            LLMConfig(
                model_loading_config={"model_id": VLLM, "model_source": str(path)},
                llm_engine="vLLM",
                engine_kwargs={**kwargs, "enforce_eager": True},
            )
        )
    try:  # on the directory's shared Serve instance (tests/serve/conftest.py)
        serve.run(build_openai_app(LLMServingArgs(llm_configs=configs)), name="fuzz", route_prefix="/")
        yield serve_url
    finally:
        serve.delete("fuzz")


@pytest.fixture(scope="module")
def document(app) -> dict:
    r = httpx.get(f"{app}/openapi.json", timeout=60)
    assert r.status_code == 200
    return r.json()


def _validate(document: dict, instance, ref: dict) -> None:
    jsonschema.validate(instance, {**ref, "components": document["components"]})


def test_the_document_describes_the_request_and_response_models(document):
    paths, schemas = document["paths"], document["components"]["schemas"]
    for path, name in REQUEST_MODELS.items():
        op = paths[path]["post"]
        body = op["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith(name)
        assert "200" in op["responses"] and "400" in op["responses"] and "422" not in op["responses"]
        jsonschema.Draft202012Validator.check_schema(schemas[name])
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["model", "prompt"]
    assert completion["properties"]["n"] == {
        "default": 1, "maximum": 128, "minimum": 1, "title": "N", "type": "integer"
    }  # fmt: skip
    temperature = completion["properties"]["temperature"]["anyOf"][0]
    assert temperature == {"maximum": 2.0, "minimum": 0.0, "type": "number"}
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    streamed = paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"
    }
    assert "HTTPValidationError" not in schemas


def test_the_models_route_and_the_head_dim_8_model_under_auto(app, document):
    from ray import serve

    models = httpx.get(f"{app}/v1/models", timeout=60).json()
    _validate(document, models, {"$ref": "#/components/schemas/ModelList"})
    assert {m["id"] for m in models["data"]} == ({AUTO, VLLM} if vllm_available() else {AUTO})
    info = serve.get_deployment_handle(f"LLMServer:{AUTO}", app_name="fuzz").describe.remote().result()
    assert info["engine"] == "embedded"
    r = httpx.get(f"{app}/v1/models/%00", timeout=60)  # a path parameter FastAPI checks itself
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _check(document: dict, path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (path, response.status_code, response.text[:500])
    responses = document["paths"][path]["post"]["responses"]
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        for event in events[:-1]:
            assert json.loads(event).get("error", {}).get("type") != "internal_error", event
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1])
        return
    schema = responses[str(response.status_code)]["content"]["application/json"]["schema"]
    _validate(document, response.json(), schema)


def _normal_requests_work(app: str, model: str) -> None:
    r = httpx.post(
        f"{app}/v1/completions",
        json={"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0},
        timeout=TIMEOUT_S,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{app}/v1/chat/completions", json=chat, timeout=TIMEOUT_S).status_code == 200


@pytest.mark.parametrize(
    "model",
    [
        AUTO,
        pytest.param(VLLM, marks=pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")),
    ],
)
def test_fuzz_from_the_openapi_document(app, document, model):
    """No 5xx, no hang (each request within TIMEOUT_S), every answer as documented; then normal requests
    are served."""
    strategies = {path: request_bodies(document, path, [model]) for path in POSTS}
    path_and_body = st.sampled_from(POSTS).flatmap(lambda p: st.tuples(st.just(p), strategies[p]))

    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(base_url=app, timeout=TIMEOUT_S) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(path_and_body)
        def fuzz(case):
            path, body = case
            raw = json.dumps(body).encode()  # NaN and Infinity too (httpx's json= refuses them)
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            seen[path, response.status_code] += 1
            _check(document, path, response)

        fuzz()
    print(model, sorted(seen.items()))  # what the fuzz reached (pytest -s)
    served = sum(n for (path, status), n in seen.items() if status == 200 and path != "/v1/embeddings")
    assert served >= EXAMPLES // 10, f"the fuzz rarely got past validation: {sorted(seen.items())}"
    _normal_requests_work(app, model)


def test_fastapi_validation_errors_are_openai_400s_naming_the_param():
    """No route lets FastAPI validate a body, but a parameter FastAPI checks answers like the rest."""
    import asyncio

    from fastapi.exceptions import RequestValidationError

    from tpuray.serve.llm.app import _validation_error

    error = {
        "loc": ("path", "model"),
        "msg": "Input should be a valid string",
        "type": "string_type",
        "input": 1,
    }
    response = asyncio.run(_validation_error(None, RequestValidationError([error])))  # type: ignore[arg-type]
    assert response.status_code == 400
    body = json.loads(response.body)["error"]
    assert body["param"] == "model" and body["code"] == "invalid_value" and "(got 1)" in body["message"]
