"""KubeRay manifests (RayCluster / RayJob / RayService) for GKE TPU node pools, as plain dicts.

One TPU worker group, one replica per slice: KubeRay creates `numOfHosts` pods per replica, GKE puts
them on one TPU slice node pool (node selectors), and each pod gets a whole host (`google.com/tpu` =
chips per host). What we set versus what the stack sets on its own:

- We set: node selectors, `google.com/tpu` limits/requests, `numOfHosts`, replicas = slices, and
  Ray's `TPU` resource in rayStartParams (KubeRay would derive the same value from the limit).
- GKE sets TPU_ACCELERATOR_TYPE / TPU_TOPOLOGY in TPU containers; KubeRay's TPU webhook (part of
  GKE's Ray add-on) sets TPU_NAME, TPU_WORKER_ID and TPU_WORKER_HOSTNAMES per pod. From those Ray
  derives, on every host, the resources `TPU-<pod type>-head` (worker 0) and `<TPU_NAME>` and the
  labels `ray.io/tpu-slice-name`, `ray.io/tpu-worker-id`, `ray.io/tpu-topology`,
  `ray.io/tpu-pod-type` - the same ones tpuray's emulator gives emulated hosts. A fixed cluster need
  not set them; an autoscaled group declares the two that are the same on every host (pod type,
  topology; on a single-host slice also worker id 0) in its `labels`, so Ray's autoscaler can match
  slice demand to it (`autoscaler_node_labels`).
- TorchTPU's per-process variables (TPU_VISIBLE_CHIPS, TORCH_TPU_*) are per worker process, set at
  run time by Ray and tpuray.train, not per pod. libtpu's premapped host buffer
  (`K8sConfig.host_transfer_env`) is set in the TPU container: torch_tpu reads it as torch loads.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from tpuray.constants import POD_TYPE_LABEL, TOPOLOGY_LABEL, WORKER_ID_LABEL
from tpuray.k8s.config import (
    GKE_ACCELERATOR_LABEL,
    GKE_SPOT_LABEL,
    GKE_TOPOLOGY_LABEL,
    GKE_TPU_RESOURCE,
    K8sConfig,
)

API_VERSION = "ray.io/v1"
HEAD_PORTS = (("gcs", 6379), ("dashboard", 8265), ("client", 10001), ("serve", 8000))


def _resources(cpu: str, memory: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    amounts = {"cpu": cpu, "memory": memory, **(extra or {})}
    return {"limits": dict(amounts), "requests": dict(amounts)}


def _shm_volume() -> dict[str, Any]:
    return {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def head_group_spec(cfg: K8sConfig) -> dict[str, Any]:
    """CPU-only head: GCS, dashboard, drivers, Train controller, Serve proxy."""
    container = {
        "name": "ray-head",
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": _resources(cfg.head_cpu, cfg.head_memory),
        "ports": [{"containerPort": port, "name": name} for name, port in HEAD_PORTS],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {
        "rayStartParams": {},
        "template": {"spec": {"containers": [container], "volumes": [_shm_volume()]}},
    }


def _tolerations(cfg: K8sConfig) -> list[dict[str, str]]:
    # GKE taints TPU nodes (it usually adds this toleration itself) and spot nodes.
    out = [{"key": GKE_TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if cfg.spot:
        out.append({"key": GKE_SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    return out


def tpu_worker_group_spec(cfg: K8sConfig) -> dict[str, Any]:
    """One worker group; each replica is one TPU slice of `numOfHosts` pods, one pod per host."""
    topo = cfg.slice_topology
    chips = str(topo.chips_per_host)
    container = {
        "name": "ray-worker",
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": _resources(cfg.worker_cpu, cfg.worker_memory, {GKE_TPU_RESOURCE: chips}),
        "env": [{"name": k, "value": v} for k, v in cfg.host_transfer_env()],  # read as torch loads
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    scale = cfg.autoscale
    group: dict[str, Any] = {
        "groupName": cfg.worker_group_name,
        "replicas": cfg.num_slices,
        "minReplicas": scale.min_slices if scale else cfg.num_slices,
        "maxReplicas": scale.max_slices if scale else cfg.num_slices,
        "numOfHosts": topo.num_hosts,
        # Same format KubeRay writes when it derives this from google.com/tpu itself.
        "rayStartParams": {
            "resources": "'" + json.dumps({"TPU": topo.chips_per_host}, separators=(",", ":")) + "'"
        },
        "template": {
            "metadata": {
                "labels": {
                    "tpuray.io/pod-type": topo.pod_type,
                    "tpuray.io/topology": topo.topology,
                }
            },
            "spec": {
                "containers": [container],
                "nodeSelector": {
                    GKE_ACCELERATOR_LABEL: cfg.gke_accelerator,
                    GKE_TOPOLOGY_LABEL: topo.topology,
                    **cfg.capacity_node_selector(),
                },
                "tolerations": _tolerations(cfg),
                "volumes": [_shm_volume()],
            },
        },
    }
    if scale:
        group["labels"] = autoscaler_node_labels(cfg)
    return group


def autoscaler_node_labels(cfg: K8sConfig) -> dict[str, str]:
    """Ray node labels declared on the autoscaled group (KubeRay passes them to `ray start --labels`).

    Ray sets the same values on every TPU host by itself; declaring them lets the v2 autoscaler match
    pending demand that selects slices by pod type or topology to this group before any pod exists.
    Per-host labels (`ray.io/tpu-worker-id`, `ray.io/tpu-slice-name`) cannot be declared for multi-host
    slices: a group's labels are the same on every pod, and a user label would override Ray's per-host
    value. A single-host slice's only host is worker 0, so there the worker id is declared too (slice
    head reservations select it).
    """
    topo = cfg.slice_topology
    labels = {POD_TYPE_LABEL: topo.pod_type, TOPOLOGY_LABEL: topo.topology}
    if topo.num_hosts == 1:
        labels[WORKER_ID_LABEL] = "0"
    return labels


def ray_cluster_spec(cfg: K8sConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {"rayVersion": cfg.ray_version}
    if cfg.autoscale:
        spec["enableInTreeAutoscaling"] = True
        spec["autoscalerOptions"] = cfg.autoscale.autoscaler_options()
    spec["headGroupSpec"] = head_group_spec(cfg)
    spec["workerGroupSpecs"] = [tpu_worker_group_spec(cfg)]
    return spec


def default_serve_config(cfg: K8sConfig) -> dict[str, Any]:
    """A Ray Serve config serving `cfg.model` with tpuray.serve.llm, one replica per slice, each
    replica tensor-parallel over a whole slice (one worker per chip)."""
    topo = cfg.slice_topology
    llm_config = {
        "model_loading_config": {"model_id": cfg.model},
        "accelerator_type": topo.accelerator_type,
        "accelerator_config": {"kind": "tpu", "topology": topo.topology},
        "placement_group_config": {"bundle_per_worker": {"TPU": 1}},
        "engine_kwargs": {"tensor_parallel_size": topo.num_chips},
        # Autoscaled from 0 slices, one replica still asks for one slice (the autoscaler brings it up).
        "deployment_config": {"num_replicas": max(cfg.num_slices, 1)},
    }
    return _openai_app({"llm_configs": [llm_config]}, cfg)


def _openai_app(args: dict[str, Any], cfg: K8sConfig) -> dict[str, Any]:
    app: dict[str, Any] = {
        "name": "llm",
        "route_prefix": "/",
        "import_path": "tpuray.serve.llm:build_openai_app",
        "args": args,
    }
    if cfg.runtime_env:
        app["runtime_env"] = dict(cfg.runtime_env)
    return {"applications": [app]}


def serve_config(cfg: K8sConfig) -> dict[str, Any]:
    if cfg.serve_config is None:
        return default_serve_config(cfg)
    if "applications" in cfg.serve_config:
        return dict(cfg.serve_config)
    return _openai_app(dict(cfg.serve_config), cfg)


def _metadata(cfg: K8sConfig) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": cfg.name}
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    meta["labels"] = {"app.kubernetes.io/created-by": "tpuray"}
    return meta


def build_manifest(cfg: K8sConfig) -> dict[str, Any]:
    """The manifest for `cfg.kind` as a dict (apply with `kubectl apply -f`)."""
    cluster = ray_cluster_spec(cfg)
    if cfg.kind == "RayCluster":
        spec = cluster
    elif cfg.kind == "RayJob":
        spec = {"entrypoint": cfg.entrypoint}
        if cfg.runtime_env:
            spec["runtimeEnvYAML"] = _dump(dict(cfg.runtime_env))
        spec.update(
            {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 300, "rayClusterSpec": cluster}
        )
    else:
        spec = {"serveConfigV2": _dump(serve_config(cfg)), "rayClusterConfig": cluster}
    return {"apiVersion": API_VERSION, "kind": cfg.kind, "metadata": _metadata(cfg), "spec": spec}


class _Dumper(yaml.SafeDumper):
    pass


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None  # embedded YAML (serveConfigV2) stays readable
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)


def _dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def to_yaml(manifest: dict[str, Any], comment: str | None = None) -> str:
    """YAML text for `kubectl apply -f`, with an optional leading `# comment` block."""
    text = _dump(manifest)
    if comment:
        text = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines()) + text
    return text


def render(cfg: K8sConfig) -> str:
    """`build_manifest` as YAML, headed by a comment describing the slices."""
    topo = cfg.slice_topology
    pools = f"({cfg.gke_accelerator}, topology {topo.topology})"
    if cfg.autoscale:
        needs = f"GKE TPU node pools {pools} that can grow to {cfg.max_slices} slices (node pool\nautoscaling or node auto-provisioning)"
    else:
        needs = f"a GKE node pool per slice {pools}"
    comment = (
        f"Generated by tpuray: {cfg.describe()}.\n"
        f"Needs {needs}, the KubeRay operator and its TPU webhook\n"
        "(GKE Ray add-on), and an image with tpuray[tpu] installed."
    )
    return to_yaml(build_manifest(cfg), comment)
