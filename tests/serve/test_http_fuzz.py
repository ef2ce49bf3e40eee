"""The app's OpenAPI document describes the real request and response models, and the HTTP surface holds
under fuzzing driven by that document (issue 22, item 6):
- "tiny-auto" here: the tiny model (head_dim 8) under llm_engine "auto": vLLM's CPU attention cannot run
  it, so the embedded engine serves it (issue 22, item 1: a live endpoint that answers, not a dead vLLM);
- vLLM: the same fuzz runs in test_vllm.py against that module's vLLM app (its TP=1 model), which pays
  vLLM's start-up once for both.
Every fuzzed request gets an answer below 500 within its timeout, a documented response (validated against
the document's schema with jsonschema), and the model answers a normal request afterwards.
TPURAY_FUZZ_EXAMPLES sets the examples per engine (default 200)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from _openapi_fuzz import EXAMPLES, REQUEST_MODELS, fuzz_app, validate

pytestmark = pytest.mark.slow  # ~1.5 min: make test-fast skips it, make test (CI) runs it

AUTO = "tiny-auto"


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
    validate(document, models, {"$ref": "#/components/schemas/ModelList"})
    assert {m["id"] for m in models["data"]} == {AUTO}
    info = serve.get_deployment_handle(f"LLMServer:{AUTO}", app_name="fuzz").describe.remote().result()
    assert info["engine"] == "embedded"
    r = httpx.get(f"{app}/v1/models/%00", timeout=60)  # a path parameter FastAPI checks itself
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_fuzz_from_the_openapi_document(app, document):
    """No 5xx, no hang (each request within TIMEOUT_S), every answer as documented; then normal requests
    are served."""
    fuzz_app(app, document, AUTO, EXAMPLES)


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
