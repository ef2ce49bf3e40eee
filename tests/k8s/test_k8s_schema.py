"""Validation against KubeRay's CRD schemas.

The converter (openAPIV3Schema -> strict JSON Schema) is tested on small schemas always. The tests against
KubeRay's real CRDs run when the CRD files are found (TPURAY_KUBERAY_CRDS, or shared/kuberay/ in or beside
the checkout; see docs/k8s.md) and are skipped, saying so, otherwise."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from tpuray.k8s import AutoscaleConfig, K8sConfig, build_manifest
from tpuray.k8s.schema import (
    CRD_FILES,
    _list_type,
    cel_rule_paths,
    crds_available,
    load_crd,
    to_json_schema,
    validation_errors,
)

from .test_k8s_autoscale import SHAPES
from .test_k8s_manifests import CASES, IDS, KIND_ARGS

needs_crds = pytest.mark.skipif(
    not crds_available(),
    reason="KubeRay CRD files not found: set TPURAY_KUBERAY_CRDS (see docs/k8s.md)",
)

SMALL = {
    "type": "object",
    "properties": {
        "port": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
        "bare": {"x-kubernetes-int-or-string": True},
        "maybe": {"type": "string", "nullable": True},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
            },
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
    },
}


@pytest.mark.parametrize(
    ("instance", "ok"),
    [
        ({"port": 80, "bare": "http", "maybe": None, "free": {"anything": 1}}, True),
        ({"port": "http", "bare": 8080}, True),
        ({"port": 1.5}, False),
        ({"bare": [1]}, False),
        ({"unknown": 1}, False),
        ({"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "1"}]}, True),
        ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, False),
        ({"env": [{"name": "A", "valu": "1"}]}, False),
        ({"tags": ["a", "b"]}, True),
        ({"tags": ["a", "a"]}, False),
    ],
)
def test_converter_is_strict_like_the_api_server(instance, ok):
    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})
    errors = list(cls(to_json_schema(SMALL)).iter_errors(instance))
    assert (not errors) == ok, errors


@needs_crds
def test_crd_files_are_kuberays():
    for kind in CRD_FILES:
        crd = load_crd(kind)
        assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io"
        assert crd["spec"]["names"]["kind"] == kind
        assert any(v["name"] == "v1" for v in crd["spec"]["versions"])


@needs_crds
@pytest.mark.parametrize("kind", list(KIND_ARGS))
@pytest.mark.parametrize(("acc", "topology", "num_slices", "hosts", "chips"), CASES, ids=IDS)
def test_every_generation_validates_against_kuberay_crd(kind, acc, topology, num_slices, hosts, chips):
    cfg = K8sConfig(acc, topology, num_slices=num_slices, kind=kind, **KIND_ARGS[kind])
    assert validation_errors(build_manifest(cfg)) == []


@needs_crds
@pytest.mark.parametrize("kind", list(KIND_ARGS))
@pytest.mark.parametrize("capacity", [{"spot": True}, {"reservation": "tpu-res-1"}])
def test_spot_and_reservation_validate_against_kuberay_crd(kind, capacity):
    cfg = K8sConfig("TPU-V6E", "4x4", num_slices=2, kind=kind, **KIND_ARGS[kind], **capacity)
    assert validation_errors(build_manifest(cfg)) == []


AUTOSCALE = {
    "defaults": AutoscaleConfig(),
    "all options": AutoscaleConfig(
        min_slices=1, max_slices=4, idle_timeout_s=600, upscaling_mode="Aggressive"
    ),
}


@needs_crds
@pytest.mark.parametrize("kind", list(KIND_ARGS))
@pytest.mark.parametrize(("acc", "topology", "hosts"), SHAPES)
@pytest.mark.parametrize("scale", list(AUTOSCALE))
def test_autoscaled_manifests_validate_against_kuberay_crd(kind, acc, topology, hosts, scale):
    autoscale = AUTOSCALE[scale]
    cfg = K8sConfig(
        acc, topology, num_slices=autoscale.min_slices, kind=kind, autoscale=autoscale, **KIND_ARGS[kind]
    )
    assert validation_errors(build_manifest(cfg)) == []


@pytest.fixture(scope="module")
def autoscaled() -> dict:
    return build_manifest(K8sConfig("TPU-V6E", "4x4", num_slices=1, autoscale=AUTOSCALE["all options"]))


AUTOSCALE_MUTATIONS = {
    "upscalingMode outside KubeRay's enum": lambda m: m["spec"]["autoscalerOptions"].__setitem__(
        "upscalingMode", "Fast"
    ),
    "autoscaler version outside the enum": lambda m: m["spec"]["autoscalerOptions"].__setitem__(
        "version", "v3"
    ),
    "enableInTreeAutoscaling as text": lambda m: m["spec"].__setitem__("enableInTreeAutoscaling", "yes"),
    "idleTimeoutSeconds as text": lambda m: m["spec"]["autoscalerOptions"].__setitem__(
        "idleTimeoutSeconds", "1m"
    ),
    "unknown autoscalerOptions field": lambda m: m["spec"]["autoscalerOptions"].__setitem__("minSlices", 1),
    "group labels not a map of strings": lambda m: _group(m).__setitem__(
        "labels", {"ray.io/tpu-topology": 4}
    ),
}


@pytest.fixture(scope="module")
def cluster() -> dict:
    return build_manifest(K8sConfig("TPU-V6E", "4x4", num_slices=2))


def _group(m: dict) -> dict:
    return m["spec"]["workerGroupSpecs"][0]


def _container(m: dict) -> dict:
    return _group(m)["template"]["spec"]["containers"][0]


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


# Each mutation must be caught: the validation is not vacuous.
MUTATIONS = {
    "typo in numOfHosts": lambda m: _rename(_group(m), "numOfHosts", "numOfHost"),
    "replicas as text": lambda m: _group(m).__setitem__("replicas", "two"),
    "unknown spec field": lambda m: m["spec"].__setitem__("tpuTopology", "4x4"),
    "bad quantity": lambda m: _container(m)["resources"]["limits"].__setitem__("google.com/tpu", "4 chips"),
    "nodeSelector not a map of strings": lambda m: _group(m)["template"]["spec"].__setitem__(
        "nodeSelector", {"cloud.google.com/gke-tpu-topology": ["4x4"]}
    ),
    "duplicate container names": lambda m: _group(m)["template"]["spec"]["containers"].append(
        copy.deepcopy(_container(m))
    ),
    "missing minReplicas": lambda m: _group(m).pop("minReplicas"),
    "missing headGroupSpec": lambda m: m["spec"].pop("headGroupSpec"),
    "wrong apiVersion": lambda m: m.__setitem__("apiVersion", "ray.io/v1alpha2"),
    "env value not a string": lambda m: _container(m).__setitem__("env", [{"name": "A", "value": 1}]),
}


@needs_crds
@pytest.mark.parametrize(
    ("base", "mutation"),
    [("cluster", name) for name in MUTATIONS] + [("autoscaled", name) for name in AUTOSCALE_MUTATIONS],
)
def test_validation_catches_broken_manifests(request, base, mutation):
    m = copy.deepcopy(request.getfixturevalue(base))
    assert validation_errors(m) == []
    {**MUTATIONS, **AUTOSCALE_MUTATIONS}[mutation](m)
    assert validation_errors(m), mutation


@needs_crds
def test_int_or_string_fields_accept_both(cluster):
    m = copy.deepcopy(cluster)
    _container(m)["ports"] = [{"containerPort": 8471, "name": "slicebuilder"}]
    _container(m)["livenessProbe"] = {"httpGet": {"port": "http", "path": "/"}}
    _container(m)["readinessProbe"] = {"httpGet": {"port": 52365, "path": "/"}}
    assert validation_errors(m) == []


def _nodes_at(node, path: tuple[str, ...]) -> list:
    """The values at `path` in a manifest ("[]" steps into every item of a list)."""
    if not path:
        return [node]
    head, rest = path[0], path[1:]
    if head == "[]":
        return [v for item in node for v in _nodes_at(item, rest)] if isinstance(node, list) else []
    if isinstance(node, dict) and head in node:
        return _nodes_at(node[head], rest)
    return []


@needs_crds
def test_we_set_no_field_guarded_by_unchecked_cel_rules():
    """Fixed and autoscaled manifests of every kind stay clear of fields whose rules we cannot check."""
    for kind, kwargs in KIND_ARGS.items():
        paths = cel_rule_paths(kind)
        # The walk must find KubeRay's CEL rules: an empty list would make the checks below vacuous.
        assert paths, f"no CEL rules found in the {kind} CRD: the walk is broken or the CRD changed"
        assert ("spec", "managedBy") in paths, (kind, paths)
        fixed = build_manifest(K8sConfig("v6e", "4x4", kind=kind, **kwargs))
        scaled = build_manifest(
            K8sConfig("v6e", "4x4", kind=kind, autoscale=AutoscaleConfig(max_slices=2), **kwargs)
        )
        for manifest in (fixed, scaled):
            for path in paths:
                assert _nodes_at(manifest, path) == [], (kind, path)
        manifest = fixed
        # the check sees such a field where a manifest sets it (including inside lists)
        manifest["spec"]["managedBy"] = "ray.io/kuberay-operator"
        assert [p for p in paths if _nodes_at(manifest, p)] == [("spec", "managedBy")]
    assert _nodes_at({"a": [{"b": 1}, {}, {"b": 2}]}, ("a", "[]", "b")) == [1, 2]
