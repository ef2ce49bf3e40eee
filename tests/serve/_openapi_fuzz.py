"""Hypothesis strategies from an OpenAPI document's JSON schemas (a small generator: hypothesis-jsonschema
and schemathesis are not installed). Values follow the schema's types and bounds, with sizes kept small
so that one example costs at most a short generation; `request_bodies` then breaks some of them (a field
of the wrong type, an unknown model) so that the error paths are fuzzed too."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

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


def request_bodies(document: dict[str, Any], path: str, models: list[str]) -> st.SearchStrategy[Any]:
    """Bodies for POST `path` from its documented request schema: mostly valid for one of `models`, some
    with a field broken (a value of another type) or an unknown model, a few not even objects."""
    gen = SchemaStrategies(document)
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # hypothesis favours small draws: 0 (its favourite) is the valid choice, the rare high ones break things
    model = st.integers(0, 9).flatmap(
        lambda i: st.sampled_from(models) if i < 8 else st.text(max_size=6) if i == 8 else JUNK
    )  # mostly a served model, sometimes another name or not a string

    @st.composite
    def body(draw: st.DrawFn) -> Any:
        fields = draw(gen.values(schema))
        if "model" in fields or draw(st.booleans()):
            fields["model"] = draw(model)
        if fields and draw(st.integers(0, 4)) == 4:  # one field of another type
            fields[draw(st.sampled_from(sorted(fields)))] = draw(JUNK)
        return fields

    return st.one_of(body(), body(), body(), body(), body(), JUNK)
