"""KubeRay manifests for GKE TPU node pools (`tpuray k8s`).

    >>> from tpuray.k8s import K8sConfig, build_manifest, render
    >>> cfg = K8sConfig("TPU-V6E", "4x4", num_slices=2)
    >>> group = build_manifest(cfg)["spec"]["workerGroupSpecs"][0]
    >>> group["numOfHosts"], group["replicas"]
    (4, 2)

`K8sConfig(..., num_slices=0, autoscale=AutoscaleConfig(min_slices=0, max_slices=4))` lets Ray's autoscaler
add and remove whole slices (docs/autoscaling-k8s.md).

`tpuray.k8s.schema.validate(manifest)` checks a manifest against KubeRay's CRD schemas (see docs/k8s.md).
"""

from tpuray.k8s.autoscale import AUTOSCALER_VERSIONS, UPSCALING_MODES, AutoscaleConfig
from tpuray.k8s.config import (
    GKE_ACCELERATOR_LABEL,
    GKE_TOPOLOGY_LABEL,
    GKE_TPU_ACCELERATORS,
    GKE_TPU_RESOURCE,
    KINDS,
    K8sConfig,
    gke_accelerator,
)
from tpuray.k8s.manifests import build_manifest, ray_cluster_spec, render, serve_config, to_yaml

__all__ = [
    "AUTOSCALER_VERSIONS",
    "AutoscaleConfig",
    "UPSCALING_MODES",
    "GKE_ACCELERATOR_LABEL",
    "GKE_TOPOLOGY_LABEL",
    "GKE_TPU_ACCELERATORS",
    "KINDS",
    "GKE_TPU_RESOURCE",
    "K8sConfig",
    "build_manifest",
    "gke_accelerator",
    "ray_cluster_spec",
    "render",
    "serve_config",
    "to_yaml",
]
