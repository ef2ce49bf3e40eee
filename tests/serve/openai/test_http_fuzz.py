"""The app's OpenAPI document describes the real request and response models, and the HTTP surface holds
under fuzzing driven by that document (issue 22, item 6):
- "tiny-auto" here: the tiny model (head_dim 8) under llm_engine "auto": vLLM's CPU attention cannot run
  it, so the embedded engine serves it (issue 22, item 1: a live endpoint that answers, not a dead vLLM);
- vLLM: the same fuzz runs in test_vllm.py against its vLLM TP=1 app.
The app's tests are in the `full` test tier (`make test-all`): CI sends the same bad and malformed
requests to vLLM (test_vllm.py) and to the embedded engine in process (test_bad_input.py).
Every fuzzed request gets an answer below 500 within its timeout, a documented response (validated against
the document's schema with jsonschema), and the model answers a normal request afterwards.
TPURAY_FUZZ_EXAMPLES sets the examples per engine (default 200 here, 100 on vLLM in test_vllm.py).
The same app answers the malformed and unusual requests of issue 22, item 5 over HTTP (test_bad_input.py
checks the rest of them in process)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest
from _bad_requests import body, check_answers_alike
from _openapi_fuzz import EXAMPLES, REQUEST_MODELS, fuzz_app, validate

pytestmark = pytest.mark.slow  # ~1.5 min: make test-fast skips it, make test (CI) runs it

AUTO = "tiny-auto"
FULL = pytest.mark.full(
    "CI: the same bad and malformed requests to vLLM over HTTP (serve/backends/test_vllm.py::test_vllm_answers_like_"
    "the_embedded_engine) and to the embedded engine in process (serve/openai/test_bad_input.py), llm_engine "
    "'auto' serving a head_dim-8 model with the embedded engine (serve/backends/test_engine_proof.py)"
)


@pytest.fixture(scope="module")
def app(serve_url, tiny_model_dir):
    from ray import serve

    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    kwargs = {"max_model_len": 128, "max_num_seqs": 8, "dtype": "float32"}
    configs = [
        LLMConfig(
            model_loading_config={"model_id": AUTO, "model_source": tiny_model_dir},
            llm_engine="auto",
            engine_kwargs=kwargs,
        )
    ]
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


@FULL
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


@FULL
def test_the_models_route_and_the_head_dim_8_model_under_auto(app, document):
    from ray import serve

    models = httpx.get(f"{app}/v1/models", timeout=60).json()
    validate(document, models, {"$ref": "#/components/schemas/ModelList"})
    assert {m["id"] for m in models["data"]} == {AUTO}
    info = serve.get_deployment_handle(f"LLMServer:{AUTO}", app_name="fuzz").describe.remote().result()
    assert info["engine"] == "embedded"
    r = httpx.get(f"{app}/v1/models/%00", timeout=60)  # a path parameter FastAPI checks itself
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@FULL
def test_fuzz_from_the_openapi_document(app, document):
    """No 5xx, no hang (each request within TIMEOUT_S), every answer as documented; then normal requests
    are served."""
    fuzz_app(app, document, AUTO, EXAMPLES)


# -- malformed or unusual input over HTTP (issue 22, item 5), on this module's app ------------------------

JSON = {"Content-Type": "application/json"}


@FULL
def test_http_answers_of_both_engines(app):
    """The embedded engine answers the list test_vllm.py sends to vLLM alike (_bad_requests.py): 400s
    naming the param (streamed too), 200s."""
    with httpx.Client(base_url=app, headers=JSON, timeout=120) as http:
        check_answers_alike(http, AUTO)


@FULL
def test_http_malformed_bodies_are_400s_and_large_ones_413s_without_stalling_others(app):
    async def go() -> None:
        async with httpx.AsyncClient(base_url=app, headers=JSON, timeout=120) as http:
            for raw in (b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"[" * 100_000):
                r = await http.post("/v1/completions", content=raw)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            r = await http.post("/tokenize", content=b'{"prompt": "\xff\xfe"}')  # not UTF-8
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            ok = body(AUTO, "completions", {})
            small = [http.post("/v1/completions", json=ok) for _ in range(4)]
            huge = {"model": AUTO, "prompt": "x" * 10_000_000}
            start = time.perf_counter()
            results = await asyncio.gather(http.post("/v1/completions", json=huge), *small)
            assert results[0].status_code == 413 and results[0].json()["error"]["code"] == "request_too_large"
            assert all(r.status_code == 200 for r in results[1:])
            assert time.perf_counter() - start < 10
            big = {"model": AUTO, "prompt": "a b " * 1_000_000}  # under the byte limit: refused unencoded
            r = await http.post("/v1/completions", json=big)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

    asyncio.run(go())


def test_fastapi_validation_errors_are_openai_400s_naming_the_param():
    """No route lets FastAPI validate a body, but a parameter FastAPI checks answers like the rest."""
    import asyncio

    from fastapi.exceptions import RequestValidationError

    from tpuray.serve.llm.openai.errors import validation_error

    error = {
        "loc": ("path", "model"),
        "msg": "Input should be a valid string",
        "type": "string_type",
        "input": 1,
    }
    response = asyncio.run(validation_error(None, RequestValidationError([error])))  # type: ignore[arg-type]
    assert response.status_code == 400
    body = json.loads(response.body)["error"]
    assert body["param"] == "model" and body["code"] == "invalid_value" and "(got 1)" in body["message"]
