"""Load a script from examples/ as a module (its fit() sits under __main__, so nothing runs), pickled by
value so Ray workers get its training function without importing the examples folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import ray.cloudpickle

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(filename: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{Path(filename).stem}", EXAMPLES / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module
