"""Optional dependencies: import them where a feature needs them, with an error that says how to get them."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(ImportError):
    """An optional package a feature needs is not installed (the message says how to install it)."""


def require(module: str, extra: str, feature: str, package: str | None = None) -> ModuleType:
    """`import module`, or MissingDependency naming the feature and the tpuray extra that installs it
    (`package`: the pip name when it is not the module's, e.g. "mlflow-skinny" for mlflow)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise MissingDependency(
            f"{feature} needs the {top!r} package, which is not installed: pip install 'tpuray[{extra}]' "
            f"(or pip install {package or top})"
        ) from e
