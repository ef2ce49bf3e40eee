"""`tpuray.k8s` manifests: every TPU field agrees with the topology model, with GKE's node labels, with
KubeRay's validation rules and with how Ray's own KubeRay autoscaler reads the manifest. (Validation against
KubeRay's CRD schemas: test_k8s_schema.py.)"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.autoscaler._private.kuberay.utils import (
    gke_tpu_accelerator_to_generation,
    tpu_node_selectors_to_type,
)

from tpuray.k8s import K8sConfig, build_manifest, ray_cluster_spec
from tpuray.k8s.config import quantity_bytes
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError

# GKE's cloud.google.com/gke-tpu-accelerator values (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus).
GKE_ACCELERATOR = {
    "TPU-V4": "tpu-v4-podslice",
    "TPU-V5LITEPOD": "tpu-v5-lite-podslice",
    "TPU-V5P": "tpu-v5p-slice",
    "TPU-V6E": "tpu-v6e-slice",
    "TPU-V7X": "tpu7x",
}

# (accelerator type as a user types it, topology, slices, expected hosts per slice, chips per host)
CASES = [
    ("TPU-V4", "2x2x1", 1, 1, 4),
    ("v4", "2x2x2", 2, 2, 4),
    ("TPU-V4", "4x4x4", 1, 16, 4),
    ("v5e", "1x1", 1, 1, 1),
    ("TPU-V5LITEPOD", "2x4", 3, 1, 8),
    ("TPU-V5LITEPOD", "4x4", 2, 4, 4),
    ("v5litepod", "16x16", 1, 64, 4),
    ("TPU-V5P", "2x2x1", 1, 1, 4),
    ("v5p", "2x4x4", 4, 8, 4),
    ("TPU-V6E", "2x2", 1, 1, 4),
    ("TPU-V6E", "2x4", 1, 1, 8),
    ("TPU-V6E", "4x4", 1, 4, 4),
    ("trillium", "8x16", 2, 32, 4),
    ("TPU-V7X", "2x2x1", 1, 1, 4),
    ("tpu7x", "2x2x4", 2, 4, 4),
    ("TPU-V7X", "4x4x8", 1, 32, 4),
]
KIND_ARGS = {
    "RayCluster": {},
    "RayJob": {"entrypoint": "python train.py", "runtime_env": {"pip": ["tpuray[tpu]"]}},
    "RayService": {"model": "google/gemma-3-1b-it"},
}
IDS = [f"{a}-{t}-x{n}" for a, t, n, _, _ in CASES]


def _cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return {
        "RayCluster": spec,
        "RayJob": spec.get("rayClusterSpec"),
        "RayService": spec.get("rayClusterConfig"),
    }[manifest["kind"]]


def check_tpu_fields(manifest: dict, topo: SliceTopology, num_slices: int) -> None:
    """Every TPU-related field of the manifest against the topology model and GKE's names."""
    spec = _cluster_spec(manifest)
    head = spec["headGroupSpec"]["template"]["spec"]
    assert all("google.com/tpu" not in c["resources"]["limits"] for c in head["containers"])
    assert "nodeSelector" not in head  # the head is a CPU pod
    (group,) = spec["workerGroupSpecs"]
    assert group["numOfHosts"] == topo.num_hosts
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == num_slices
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    for section in ("limits", "requests"):
        assert container["resources"][section]["google.com/tpu"] == str(topo.chips_per_host)
    # libtpu's premapped host buffer, read by torch_tpu as torch loads: set for every process in the pod,
    # each chip's process pinning at most a quarter of its share of the pod's memory
    env = {e["name"]: int(e["value"]) for e in container["env"]}
    size = env["TPU_PREMAPPED_BUFFER_SIZE"]
    assert size == env["TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES"] and size & (size - 1) == 0
    assert 256 << 20 <= size <= 4 << 30
    assert size * topo.chips_per_host <= quantity_bytes(container["resources"]["limits"]["memory"]) // 4
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATOR[topo.accelerator_type],
        "cloud.google.com/gke-tpu-topology": "x".join(map(str, topo.shape[: topo.generation.dims])),
    }
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topo.topology
    # Ray's TPU resource on each host == chips per host (KubeRay's quoting: '{"TPU":4}').
    value = group["rayStartParams"]["resources"]
    assert value[0] == value[-1] == "'" and json.loads(value[1:-1]) == {"TPU": topo.chips_per_host}
    # Pods x chips covers the slices exactly.
    assert num_slices * group["numOfHosts"] * topo.chips_per_host == num_slices * topo.num_chips


def check_kuberay_rules(manifest: dict) -> None:
    """The semantic checks of KubeRay's validation.go that a schema cannot express."""
    limit = {"RayCluster": 53, "RayJob": 47, "RayService": 47}[manifest["kind"]]
    name = manifest["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= limit
    spec = _cluster_spec(manifest)
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert "labels" not in group["rayStartParams"]  # KubeRay rejects rayStartParams['labels']
        assert not ("resources" in group and "resources" in group["rayStartParams"])
        pod = group["template"]["spec"]
        assert pod["containers"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
            assert all(len(p["name"]) <= 15 for p in c.get("ports", []))
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        # Label values must be valid Kubernetes label values (pod labels, and Ray node labels KubeRay
        # also puts on the pods); Ray node label keys must be qualified names.
        for key in group.get("labels", {}):
            assert re.fullmatch(
                r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", key
            )
        for value in [*group["template"]["metadata"]["labels"].values(), *group.get("labels", {}).values()]:
            assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", value) and len(value) <= 63


@pytest.mark.parametrize("kind", list(KIND_ARGS))
@pytest.mark.parametrize(("acc", "topology", "num_slices", "hosts", "chips"), CASES, ids=IDS)
def test_manifest_matches_topology(kind, acc, topology, num_slices, hosts, chips):
    cfg = K8sConfig(acc, topology, num_slices=num_slices, kind=kind, **KIND_ARGS[kind])
    topo = SliceTopology.parse(acc, topology)
    assert (topo.num_hosts, topo.chips_per_host) == (hosts, chips)  # independent expectation
    manifest = build_manifest(cfg)
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind
    check_tpu_fields(manifest, topo, num_slices)
    check_kuberay_rules(manifest)
    # The same YAML round-trips.
    assert _cluster_spec(manifest) == ray_cluster_spec(cfg)


@pytest.mark.parametrize(("acc", "topology", "num_slices", "hosts", "chips"), CASES, ids=IDS)
def test_ray_autoscaler_reads_the_slice_we_model(acc, topology, num_slices, hosts, chips):
    """Ray's own KubeRay autoscaler config derivation sees the TPU resources tpuray's emulator gives
    emulated hosts: TPU = chips per host, TPU-<pod type>-head, num_slices x num_hosts workers."""
    topo = SliceTopology.parse(acc, topology)
    manifest = build_manifest(K8sConfig(acc, topology, num_slices=num_slices, namespace="default"))
    selectors = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    gke_acc = selectors["cloud.google.com/gke-tpu-accelerator"]
    assert gke_tpu_accelerator_to_generation[gke_acc] == topo.generation.name
    assert (
        tpu_node_selectors_to_type(selectors["cloud.google.com/gke-tpu-topology"], gke_acc) == topo.pod_type
    )

    config = _derive_autoscaling_config_from_ray_cr(manifest)
    node_type = config["available_node_types"][f"tpu-{topo.pod_type}"]
    assert node_type["min_workers"] == node_type["max_workers"] == num_slices * topo.num_hosts
    resources = node_type["resources"]
    assert resources["TPU"] == topo.chips_per_host
    assert resources[topo.head_resource] == 1
    assert resources["CPU"] == 8
    assert "TPU" not in config["available_node_types"]["headgroup"]["resources"]


def test_rayjob_fields():
    cfg = K8sConfig("TPU-V6E", "4x4", kind="rayjob", entrypoint="python train.py", runtime_env={"pip": ["x"]})
    spec = build_manifest(cfg)["spec"]
    assert spec["entrypoint"] == "python train.py"
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"pip": ["x"]}
    assert spec["shutdownAfterJobFinishes"] is True


def test_rayservice_default_app_is_a_valid_tpuray_serving_config():
    from tpuray.serve.llm.config import LLMServingArgs

    cfg = K8sConfig("TPU-V6E", "4x4", num_slices=2, kind="RayService", model="my-model")
    serve = yaml.safe_load(build_manifest(cfg)["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "tpuray.serve.llm:build_openai_app"
    args = LLMServingArgs(**app["args"])  # tpuray's own validation (topology, TP size vs chips)
    (llm,) = args.llm_configs
    assert llm.topology == cfg.slice_topology
    assert llm.tensor_parallel_size == 16 and llm.deployment_config == {"num_replicas": 2}


def test_rayservice_serve_config_forms():
    app_config = {"applications": [{"name": "a", "import_path": "m:app"}]}
    cfg = K8sConfig("v6e", "2x4", kind="rayservice", serve_config=app_config)
    assert yaml.safe_load(build_manifest(cfg)["spec"]["serveConfigV2"]) == app_config
    args = {"llm_configs": [{"model_loading_config": {"model_id": "m"}}]}
    cfg = K8sConfig("v6e", "2x4", kind="rayservice", serve_config=args, runtime_env={"pip": ["p"]})
    (app,) = yaml.safe_load(build_manifest(cfg)["spec"]["serveConfigV2"])["applications"]
    assert app["args"] == args and app["runtime_env"] == {"pip": ["p"]}


def test_defaults_and_overrides():
    cfg = K8sConfig("TPU-V6E", "4x4")
    assert cfg.name == "tpuray-v6e-16" and cfg.kind == "RayCluster"
    assert cfg.image == f"rayproject/ray:{cfg.ray_version}-py311"
    cfg = K8sConfig("TPU-V6E", "4x4", name="train", namespace="ml", image="reg/img:1", ray_version="2.60.0")
    m = build_manifest(cfg)
    assert m["metadata"]["name"] == "train" and m["metadata"]["namespace"] == "ml"
    assert m["spec"]["rayVersion"] == "2.60.0"
    assert {
        c["image"]
        for g in [m["spec"]["headGroupSpec"], *m["spec"]["workerGroupSpecs"]]
        for c in g["template"]["spec"]["containers"]
    } == {"reg/img:1"}


def _llm(topology: str, replicas: int = 1, tp: int | None = None) -> dict:
    llm = {
        "model_loading_config": {"model_id": "m"},
        "accelerator_type": "TPU-V6E",
        "accelerator_config": {"kind": "tpu", "topology": topology},
        "deployment_config": {"num_replicas": replicas},
    }
    if tp is not None:
        llm["engine_kwargs"] = {"tensor_parallel_size": tp}
    return llm


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accelerator_type": "TPU-V3"}, "TPU-V3"),
        ({"topology": "3x3"}, "3x3"),
        ({"topology": "4x4x4"}, "4x4x4"),
        ({"num_slices": 0}, "num_slices"),
        ({"num_slices": 1.5}, "num_slices"),
        ({"kind": "deployment"}, "deployment"),
        ({"name": "My_Cluster"}, "My_Cluster"),
        ({"name": "x" * 54}, "at most 53"),
        ({"kind": "rayjob", "name": "x" * 48, "entrypoint": "e"}, "at most 47"),
        ({"namespace": "Bad NS"}, "Bad NS"),
        ({"image": "has space"}, "has space"),
        ({"ray_version": "latest"}, "latest"),
        ({"worker_memory": "lots"}, "lots"),
        ({"head_cpu": "-1"}, "-1"),
        ({"kind": "rayjob"}, "entrypoint"),
        ({"entrypoint": "python x.py"}, "only used by kind RayJob"),
        ({"kind": "rayservice"}, "serve_config"),
        ({"kind": "rayservice", "serve_config": {"foo": 1}}, "applications"),
        ({"model": "m"}, "only used by kind RayService"),
        ({"runtime_env": {"pip": ["x"]}}, "image"),
        (
            {"kind": "rayservice", "serve_config": {"applications": []}, "runtime_env": {"pip": ["x"]}},
            "applications instead",
        ),
        ({"kind": "rayservice", "serve_config": {"llm_configs": [_llm("2x2")]}}, "v6e-4 (2x2)"),
        ({"kind": "rayservice", "serve_config": {"llm_configs": [_llm("4x4", replicas=2)]}}, "need 2 slices"),
        (
            {"kind": "rayservice", "serve_config": {"llm_configs": [_llm("4x4", tp=4)]}},
            "tensor_parallel_size=4",
        ),
        ({"kind": "rayservice", "serve_config": {"llm_configs": ["llm.yaml"]}}, "inline mappings"),
        (
            {
                "kind": "rayservice",
                "serve_config": {
                    "applications": [
                        {
                            "import_path": "tpuray.serve.llm:build_openai_app",
                            "args": {"llm_configs": [_llm("2x4")]},
                        }
                    ]
                },
            },
            "applications[0].args",
        ),
        ({"spot": True, "reservation": "r1"}, "exclude each other"),
        ({"reservation": "R_1"}, "'R_1' is not a GCE reservation name"),
        ({"spot": "yes"}, "spot must be True or False"),
    ],
)
def test_bad_config_is_rejected_with_the_bad_value(kwargs, match):
    args = {"accelerator_type": "TPU-V6E", "topology": "4x4", **kwargs}
    with pytest.raises(ValueError, match=re.escape(match)):
        K8sConfig(**args)


@pytest.mark.parametrize(
    ("kwargs", "selector", "spot_toleration"),
    [
        ({}, {}, False),
        ({"spot": True}, {"cloud.google.com/gke-spot": "true"}, True),
        (
            {"reservation": "tpu-res-1"},
            {
                "cloud.google.com/reservation-name": "tpu-res-1",
                "cloud.google.com/reservation-affinity": "specific",
            },
            False,
        ),
    ],
)
def test_spot_and_reservation_node_selectors(kwargs, selector, spot_toleration):
    m = build_manifest(K8sConfig("TPU-V6E", "4x4", **kwargs))
    pod = m["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    capacity = {k: v for k, v in pod["nodeSelector"].items() if "gke-tpu" not in k}
    assert capacity == selector
    spot = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    assert (spot in pod["tolerations"]) == spot_toleration
    assert "nodeSelector" not in m["spec"]["headGroupSpec"]["template"]["spec"]  # the head stays on-demand


def test_kubernetes_quantities_in_bytes():
    assert quantity_bytes("32Gi") == 32 << 30 and quantity_bytes("500M") == 500_000_000
    assert quantity_bytes("1e9") == quantity_bytes("1G") == 10**9
    assert quantity_bytes("34359738368") == 32 << 30
    with pytest.raises(ConfigError, match="'32 GB' is not a Kubernetes quantity"):
        quantity_bytes("32 GB")


@pytest.mark.parametrize(
    "topology, memory, size",
    [("2x4", "32Gi", 1 << 30), ("4x4", "32Gi", 2 << 30), ("4x4", "256Gi", 4 << 30), ("2x4", "4Gi", None)],
)
def test_the_premapped_buffer_fits_each_chips_share_of_the_pod(topology, memory, size):
    """v5e: 2x4 is one 8-chip host, 4x4 four 4-chip hosts; a buffer under 256 MiB is not set at all."""
    env = dict(K8sConfig("TPU-V5E", topology, worker_memory=memory).host_transfer_env())
    names = ("TPU_PREMAPPED_BUFFER_SIZE", "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES")
    assert env == ({} if size is None else dict.fromkeys(names, str(size)))
