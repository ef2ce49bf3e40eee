"""Ray's v2 autoscaler KubeRay provider (real Ray code) scaling a `tpuray k8s --autoscale` RayCluster.

No Kubernetes API server runs in CI, so the provider talks to an in-memory one through Ray's own client
interface (`IKubernetesHttpApiClient`, which Ray provides for this): it stores the RayCluster, applies
the provider's JSON patches, and lists no pods (scaling from zero). What is checked is what Ray writes
into our manifest: `replicas` in whole slices, capped at `maxReplicas`.
"""

from __future__ import annotations

import copy
from typing import Any

from ray.autoscaler._private.kuberay.node_provider import IKubernetesHttpApiClient
from ray.autoscaler.v2.instance_manager.cloud_providers.kuberay.cloud_provider import KubeRayProvider

from tpuray.k8s import AutoscaleConfig, K8sConfig, build_manifest


class InMemoryKubernetes(IKubernetesHttpApiClient):
    """One RayCluster and no pods; PATCH applies RFC 6902 `replace` / `add` operations."""

    def __init__(self, raycluster: dict[str, Any]) -> None:
        self.raycluster = copy.deepcopy(raycluster)
        self.patches: list[list[dict[str, Any]]] = []

    def _path(self, path: str) -> str:
        name = self.raycluster["metadata"]["name"]
        return {f"rayclusters/{name}": "raycluster"}.get(path, "pods" if path.startswith("pods") else path)

    def get(self, path: str) -> dict[str, Any]:
        kind = self._path(path)
        if kind == "raycluster":
            return copy.deepcopy(self.raycluster)
        if kind == "pods":
            return {"metadata": {"resourceVersion": "1"}, "items": []}
        raise KeyError(f"in-memory Kubernetes has no {path!r}")

    def patch(
        self, path: str, payload: Any, content_type: str = "application/json-patch+json"
    ) -> dict[str, Any]:
        assert self._path(path) == "raycluster" and content_type == "application/json-patch+json", path
        self.patches.append(copy.deepcopy(payload))
        for op in payload:
            assert op["op"] in ("replace", "add"), op
            *parents, leaf = op["path"].strip("/").split("/")
            node: Any = self.raycluster
            for step in parents:
                node = node[int(step)] if isinstance(node, list) else node[step]
            node[int(leaf) if isinstance(node, list) else leaf] = op["value"]
        return copy.deepcopy(self.raycluster)

    def delete(self, path: str) -> dict[str, Any]:
        raise AssertionError(f"nothing is deleted when scaling up from zero: {path}")


def _provider(cfg: K8sConfig) -> tuple[KubeRayProvider, InMemoryKubernetes]:
    k8s = InMemoryKubernetes(build_manifest(cfg))
    provider = KubeRayProvider(cfg.name, {"namespace": "default"}, gcs_client=None, k8s_api_client=k8s)
    return provider, k8s


def _launch(provider: KubeRayProvider, group: str, hosts: int, request_id: str) -> None:
    provider.get_non_terminated()  # sync with the API server, as the instance manager does each round
    provider.launch({group: hosts}, request_id)


def test_kuberay_provider_scales_a_multi_host_group_in_whole_slices():
    cfg = K8sConfig(
        "TPU-V6E", "4x4", num_slices=0, namespace="default", autoscale=AutoscaleConfig(max_slices=2)
    )
    hosts, group = cfg.slice_topology.num_hosts, cfg.worker_group_name
    provider, k8s = _provider(cfg)

    def replicas() -> int:
        return k8s.raycluster["spec"]["workerGroupSpecs"][0]["replicas"]

    # Known gap (docs/autoscaling-k8s.md): one host of a 4-host slice rounds down to no replica.
    _launch(provider, group, 1, "one-host")
    assert replicas() == 0 and k8s.patches == []
    # A whole slice of hosts is one replica = one slice of numOfHosts pods.
    _launch(provider, group, hosts, "one-slice")
    assert replicas() == 1
    # Three more slices would make 4 > maxReplicas=2: capped at 2, the 2 slices past it refused (in hosts).
    _launch(provider, group, 3 * hosts, "three-more")
    assert replicas() == 2
    (error,) = provider.poll_errors()
    assert (error.node_type, error.count, error.request_id) == (group, 2 * hosts, "three-more")
    assert "maxReplicas" in str(error)


def test_kuberay_provider_scales_single_host_slices_one_by_one():
    cfg = K8sConfig(
        "TPU-V6E", "2x4", num_slices=0, namespace="default", autoscale=AutoscaleConfig(max_slices=3)
    )
    provider, k8s = _provider(cfg)
    _launch(provider, cfg.worker_group_name, 1, "first")
    _launch(provider, cfg.worker_group_name, 1, "second")
    assert k8s.raycluster["spec"]["workerGroupSpecs"][0]["replicas"] == 2
