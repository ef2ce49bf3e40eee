"""Config validation shared by every typed config: one error type, one check per kind of value.

`ConfigError` is a `ValueError`, so callers that catch ValueError keep working; the CLI prints it as
one line (exit code 2) while any other exception keeps its traceback.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad value in a config, a CLI flag or an API argument. The message names it and what is valid."""


def is_int(value: Any) -> bool:
    """An int that is not a bool (True is an int in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int >= `minimum`, else ConfigError naming `name`."""
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: use an integer >= {minimum}")
    return value


def check_choice(name: str, value: Any, choices: tuple | list) -> Any:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; valid: {', '.join(map(repr, choices))}")
    return value


def canonical_choice(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> str:
    """The entry of `choices` equal to `value` ignoring case and surrounding blanks, else ConfigError."""
    for choice in choices:
        if isinstance(value, str) and value.strip().lower() == choice.lower():
            return choice
    raise ConfigError(f"{name}={value!r} is not valid; valid: {', '.join(choices)}")
