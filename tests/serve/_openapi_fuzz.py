"""Hypothesis strategies from an OpenAPI document's JSON schemas (a small generator: hypothesis-jsonschema
and schemathesis are not installed). Values follow the schema's types and bounds, with sizes kept small
so that one example costs at most a short generation; `request_bodies` then breaks some of them (a field
of the wrong type, an unknown model) so that the error paths are fuzzed too. `fuzz_app` runs the fuzz
against a served app (test_http_fuzz.py: the embedded engine; test_vllm.py: vLLM)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import httpx
import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("TPURAY_FUZZ_EXAMPLES", "200"))  # fuzzed requests, embedded engine
# vLLM's app shares the protocol layer the embedded fuzz covers; its engine answers ~4x slower here, so
# half as many (300 in all, bounded for CI); TPURAY_FUZZ_EXAMPLES sets both
VLLM_EXAMPLES = int(os.environ.get("TPURAY_FUZZ_EXAMPLES", "100"))
TIMEOUT_S = 120.0  # a fuzzed request that takes longer is a hang
POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
REQUEST_MODELS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
SMALL = 8  # how far above its minimum an integer (or a list's length) goes: bounded cost per request
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


class SchemaStrategies:
    def __init__(self, document: dict[str, Any]) -> None:
        self.schemas = document.get("components", {}).get("schemas", {})

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def values(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
        schema = self.resolve(schema)
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.values(s, depth) for s in schema[key]])
        kind = schema.get("type")
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True)
            return st.text(min_size=schema.get("minLength", 0), max_size=16)
        if kind == "integer":
            if "minimum" in schema or "exclusiveMinimum" in schema:
                lo = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1)
                hi = lo + SMALL
            else:  # unbounded (token ids, seeds): small, mostly valid token ids, and -1
                lo, hi = -1, 8 * SMALL
            return st.integers(lo, min(hi, schema.get("maximum", schema.get("exclusiveMaximum", 2**63) - 1)))
        if kind == "number":
            return st.floats(
                schema.get("minimum", schema.get("exclusiveMinimum", -1e6)),
                schema.get("maximum", schema.get("exclusiveMaximum", 1e6)),
                exclude_min="exclusiveMinimum" in schema,
                exclude_max="exclusiveMaximum" in schema,
                allow_nan=False,
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            lo = schema.get("minItems", 0)
            hi = min(schema.get("maxItems", lo + 3), lo + (3 if depth < 2 else 1))
            return st.lists(self.values(schema.get("items", {}), depth + 1), min_size=lo, max_size=hi)
        if kind == "object" or "properties" in schema:
            return self.objects(schema, depth)
        return st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=4))  # any value

    def objects(self, schema: dict[str, Any], depth: int) -> st.SearchStrategy[dict[str, Any]]:
        props: dict[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties")
        if not props and isinstance(extra, dict):
            return st.dictionaries(st.text(max_size=6), self.values(extra, depth + 1), max_size=3)
        fixed = {k: self.values(v, depth + 1) for k, v in props.items() if k in required}
        optional = sorted(k for k in props if k not in required)

        @st.composite
        def some_fields(draw: st.DrawFn) -> dict[str, Any]:
            """The required fields and a few optional ones (every optional field at once is never valid)."""
            fields = draw(st.fixed_dictionaries(fixed))
            if optional:
                for key in draw(st.lists(st.sampled_from(optional), max_size=3, unique=True)):
                    fields[key] = draw(self.values(props[key], depth + 1))
            return fields

        return some_fields()


def request_bodies(document: dict[str, Any], path: str) -> st.SearchStrategy[Any]:
    """Bodies for POST `path` from its documented request schema: mostly valid, their model one the
    document offers (its enum of served models: what a schema-driven tool such as schemathesis sends),
    some with a field broken (a value of another type) or an unknown model, a few not even objects."""
    gen = SchemaStrategies(document)
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    offered = gen.values(gen.resolve(schema)["properties"]["model"])
    # hypothesis favours small draws: 0 (its favourite) is the valid choice, the rare high ones break things
    model = st.integers(0, 9).flatmap(
        lambda i: offered if i < 8 else st.text(max_size=6) if i == 8 else JUNK
    )  # mostly a model the document offers, sometimes another name or not a string

    @st.composite
    def body(draw: st.DrawFn) -> Any:
        fields = draw(gen.values(schema))
        if "model" in fields or draw(st.booleans()):
            fields["model"] = draw(model)
        if fields and draw(st.integers(0, 4)) == 4:  # one field of another type
            fields[draw(st.sampled_from(sorted(fields)))] = draw(JUNK)
        return fields

    return st.one_of(body(), body(), body(), body(), body(), JUNK)


def validate(document: dict, instance: Any, ref: dict) -> None:
    jsonschema.validate(instance, {**ref, "components": document["components"]})


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
    validate(document, response.json(), schema)


def _normal_requests_work(http: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def fuzz_app(base_url: str, document: dict, model: str, examples: int, headers: dict | None = None) -> None:
    """`examples` requests built from the app's document, for `model`: no 5xx, no hang (each within
    TIMEOUT_S), every answer as documented; then a normal completion and chat are served."""
    strategies = {path: request_bodies(document, path) for path in POSTS}
    path_and_body = st.sampled_from(POSTS).flatmap(lambda p: st.tuples(st.just(p), strategies[p]))
    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S, headers=headers or {}) as http:

        @settings(
            max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(path_and_body)
        def fuzz(case):
            path, body = case
            raw = json.dumps(body).encode()  # NaN and Infinity too (httpx's json= refuses them)
            response = http.post(path, content=raw, headers={"content-type": "application/json"})
            seen[path, response.status_code] += 1
            _check(document, path, response)

        fuzz()
        print(model, sorted(seen.items()))  # what the fuzz reached (pytest -s)
        served = sum(n for (path, status), n in seen.items() if status == 200 and path != "/v1/embeddings")
        assert served >= examples // 10, f"the fuzz rarely got past validation: {sorted(seen.items())}"
        unknown = sum(n for (_, status), n in seen.items() if status == 404)  # model_not_found
        assert unknown <= sum(seen.values()) // 4, (
            f"most requests must pass the model check: {sorted(seen.items())}"
        )
        _normal_requests_work(http, model)
