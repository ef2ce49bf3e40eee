"""Validate manifests against KubeRay's published CRD schemas (ray.io_rayclusters.yaml,
ray.io_rayjobs.yaml, ray.io_rayservices.yaml from ray-project/kuberay, Apache-2.0).

The CRD files are not part of tpuray: they are looked up, in order, in the folder named by the
environment variable TPURAY_KUBERAY_CRDS, then in `shared/kuberay/` inside or beside the source
checkout. Put the three files of a KubeRay release there (helm-chart/kuberay-operator/crds/) with
KubeRay's LICENSE.

A CRD's `openAPIV3Schema` is close to JSON Schema. We turn it into one that `jsonschema` checks the way
the Kubernetes API server does with strict field validation (`kubectl apply --validate=strict`):
- unknown fields are errors (`additionalProperties: false` on objects with `properties`, unless
  `x-kubernetes-preserve-unknown-fields`),
- `nullable: true` admits null, `x-kubernetes-int-or-string` admits an integer or a string,
- `x-kubernetes-list-type: map | set` lists must have unique keys / items.
CEL rules (`x-kubernetes-validations`) are not evaluated; `cel_rule_paths` lists where they sit.
Needs the `jsonschema` package (in tpuray's `dev` extra).
"""

from __future__ import annotations

import copy
import os
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tpuray.constants import KUBERAY_CRDS_ENV

CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
API_VERSION = "ray.io/v1"
CRDS_ENV = KUBERAY_CRDS_ENV


def crd_search_path() -> list[Path]:
    """Folders searched for the CRD files, in order."""
    out = [Path(os.environ[CRDS_ENV]).expanduser()] if os.environ.get(CRDS_ENV) else []
    checkout = Path(__file__).resolve().parents[3]  # src/tpuray/k8s/schema.py -> checkout root
    out += [checkout / "shared" / "kuberay", checkout.parent / "shared" / "kuberay"]
    return out


def find_crd_dir() -> Path | None:
    """The first searched folder holding all three CRD files, or None."""
    for folder in crd_search_path():
        if all((folder / name).is_file() for name in CRD_FILES.values()):
            return folder
    return None


def crds_available() -> bool:
    return find_crd_dir() is not None


@cache
def load_crd(kind: str) -> dict[str, Any]:
    """KubeRay's CustomResourceDefinition for `kind` (RayCluster, RayJob, RayService)."""
    if kind not in CRD_FILES:
        raise ValueError(f"no KubeRay CRD for kind {kind!r}; valid: {', '.join(CRD_FILES)}")
    folder = find_crd_dir()
    if folder is None:
        searched = ", ".join(str(p) for p in crd_search_path())
        raise FileNotFoundError(
            f"KubeRay CRD files ({', '.join(CRD_FILES.values())}) not found in: {searched}; set "
            f"{CRDS_ENV} to a folder holding them (from a KubeRay release: helm-chart/kuberay-operator/crds/)"
        )
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((folder / CRD_FILES[kind]).read_text(encoding="utf-8"), Loader=loader)


def openapi_schema(kind: str, version: str = "v1") -> dict[str, Any]:
    """The CRD's `openAPIV3Schema` for `version`, unmodified."""
    for v in load_crd(kind)["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise ValueError(f"CRD {kind} has no version {version!r}")


def to_json_schema(node: Any) -> Any:
    """Convert an openAPIV3Schema (sub)tree to strict JSON Schema (see module docstring)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if k != "properties"}
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
        if not preserve:
            out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


def _list_type(validator: Any, list_type: str, instance: Any, schema: dict[str, Any]) -> Any:
    from jsonschema import ValidationError

    if not isinstance(instance, list):
        return
    if list_type == "set":
        seen: list[Any] = []
        for item in instance:
            if item in seen:
                yield ValidationError(f"duplicate item {item!r} in a list-type=set list")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen_keys: set[tuple] = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            key = tuple(repr(item.get(k)) for k in keys)
            if key in seen_keys:
                yield ValidationError(f"duplicate entry for keys {keys} = {key} in a list-type=map list")
            seen_keys.add(key)


@cache
def validator(kind: str) -> Any:
    """A jsonschema validator for `kind` manifests."""
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - jsonschema ships with the dev extra
        raise ImportError("validating manifests needs jsonschema: pip install 'tpuray[dev]'") from e
    schema = to_json_schema(copy.deepcopy(openapi_schema(kind)))
    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})
    return cls(schema)


def validation_errors(manifest: dict[str, Any]) -> list[str]:
    """Everything wrong with `manifest` according to its kind's CRD, as readable lines ([] if valid)."""
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind not in CRD_FILES:
        return [f"kind {kind!r} is not one of {', '.join(CRD_FILES)}"]
    errors = []
    if manifest.get("apiVersion") != API_VERSION:
        errors.append(f"apiVersion {manifest.get('apiVersion')!r} != {API_VERSION!r}")
    for err in sorted(validator(kind).iter_errors(manifest), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in err.absolute_path) or "<root>"
        errors.append(f"{path}: {err.message}")
    return errors


def validate(manifest: dict[str, Any]) -> None:
    """Raise ValueError listing every schema violation of `manifest`."""
    errors = validation_errors(manifest)
    if errors:
        raise ValueError(f"{manifest.get('kind')} manifest is invalid: " + "; ".join(errors))


def cel_rule_paths(kind: str) -> list[tuple[str, ...]]:
    """Paths (property names) of schema nodes carrying CEL rules, which `validate` does not check."""
    out: list[tuple[str, ...]] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        if "x-kubernetes-validations" in node:
            out.append(path)
        for name, child in node.get("properties", {}).items():
            walk(child, (*path, name))
        if isinstance(node.get("items"), dict):
            walk(node["items"], (*path, "[]"))

    walk(openapi_schema(kind), ())
    return out
