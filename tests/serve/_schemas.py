"""JSON schemas the serving tests constrain output with (strings bounded by a pattern, so a random-weight
model finishes the JSON within a few dozen tokens)."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
