"""`K8sConfig`: what to generate for KubeRay on GKE, validated at construction.

GKE names (node selectors `cloud.google.com/gke-tpu-accelerator` / `cloud.google.com/gke-tpu-topology`)
come from the GKE TPU docs (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus) and match the
table Ray's KubeRay autoscaler uses (`ray.autoscaler._private.kuberay.utils`) and KubeRay's samples.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpuray.constants import TPU_HOST_TRANSFER_ENV
from tpuray.k8s.autoscale import AutoscaleConfig
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError, canonical_choice, check_positive_int

# Ray generation name (tpuray.topology Generation.name) -> GKE accelerator node label value.
GKE_TPU_ACCELERATORS: dict[str, str] = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
    "v7x": "tpu7x",
}
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GKE_TPU_RESOURCE = "google.com/tpu"
# GKE's capacity labels (cloud.google.com/kubernetes-engine/docs/concepts/spot-vms, .../consuming-reservations):
# spot node pools carry gke-spot=true and a NoSchedule taint of the same key; reserved capacity is picked
# with reservation-name + reservation-affinity=specific.
GKE_SPOT_LABEL = "cloud.google.com/gke-spot"
GKE_RESERVATION_LABEL = "cloud.google.com/reservation-name"
GKE_RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
_GCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

KINDS = ("RayCluster", "RayJob", "RayService")
# KubeRay's limits (ray-operator/controllers/ray/utils/constant.go): RayCluster names <= 53 chars,
# RayJob / RayService names <= 47 (the RayCluster they create gets a suffix).
MAX_NAME_LENGTH = {"RayCluster": 53, "RayJob": 47, "RayService": 47}

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes resource quantity (the pattern KubeRay's CRD uses for container resources).
_QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


MIN_PREMAPPED_BYTES = 256 << 20
_SUFFIX: dict[str, float] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIX |= {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity_bytes(value: str) -> int:
    """A Kubernetes quantity ("32Gi", "500M", "1e9", "34359738368") as a whole number of bytes."""
    if not _QUANTITY.match(value):
        raise ConfigError(f"{value!r} is not a Kubernetes quantity; valid: e.g. '32Gi', '500M', '1e9'")
    suffix = next((s for s in sorted(_SUFFIX, key=len, reverse=True) if value.endswith(s)), "")
    number = value[: len(value) - len(suffix)] if suffix else value
    return int(float(number) * _SUFFIX.get(suffix, 1))


def default_ray_version() -> str:
    """The installed Ray's version (cluster and client must match), else the version we test."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "2.60.0"


def gke_accelerator(topo: SliceTopology) -> str:
    """GKE's `cloud.google.com/gke-tpu-accelerator` value for the slice's generation."""
    name = topo.generation.name
    if name not in GKE_TPU_ACCELERATORS:
        raise ConfigError(
            f"TPU {topo.generation.family} is not offered as a GKE node pool; "
            f"valid: {', '.join(GKE_TPU_ACCELERATORS)}"
        )
    return GKE_TPU_ACCELERATORS[name]


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: fill in defaults in __post_init__


def normalize_kind(kind: str) -> str:
    return canonical_choice("kind", kind, KINDS)


@dataclass(frozen=True)
class K8sConfig:
    """A KubeRay resource for `num_slices` GKE TPU slices of one shape, plus a CPU head.

    Quantities (`*_cpu`, `*_memory`) are Kubernetes quantities ("8", "500m", "32Gi"); worker ones
    are per host (per pod). `runtime_env` goes to RayJob's runtimeEnvYAML and to the default Serve
    application; `serve_config` is a Ray Serve config (with `applications`) or the args of
    `tpuray.serve.llm:build_openai_app` (with `llm_configs`). With `autoscale`, Ray's autoscaler keeps
    between its `min_slices` and `max_slices` slices and `num_slices` (may be 0) is the initial count.
    """

    accelerator_type: str
    topology: str
    num_slices: int = 1
    kind: str = "RayCluster"
    name: str = ""  # default: "tpuray-<pod type>", e.g. "tpuray-v6e-16"
    namespace: str | None = None
    image: str = ""  # default: rayproject/ray:<ray_version>-py311 (must contain tpuray[tpu])
    ray_version: str = ""  # default: the installed Ray's version
    head_cpu: str = "4"
    head_memory: str = "16Gi"
    worker_cpu: str = "8"
    worker_memory: str = "32Gi"
    entrypoint: str | None = None
    runtime_env: Mapping[str, Any] | None = None
    serve_config: Mapping[str, Any] | None = None
    model: str | None = None
    spot: bool = False  # TPU hosts on a GKE spot node pool (preemptible: see docs/preemption.md)
    reservation: str | None = None  # TPU hosts on a specific GKE reservation
    # Ray's autoscaler adds / removes whole slices between its bounds; num_slices is then the initial count.
    autoscale: AutoscaleConfig | None = None
    slice_topology: SliceTopology = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        topo = SliceTopology.parse(self.accelerator_type, self.topology)
        gke_accelerator(topo)
        kind = normalize_kind(self.kind)
        _set(self, "slice_topology", topo)
        _set(self, "kind", kind)
        self._check_slices()
        if not self.ray_version:
            _set(self, "ray_version", default_ray_version())
        if not re.fullmatch(r"\d+\.\d+\.\d+\S*", self.ray_version):
            raise ConfigError(f"ray_version must look like 2.60.0, got {self.ray_version!r}")
        if not self.image:
            _set(self, "image", f"rayproject/ray:{self.ray_version}-py311")
        if not isinstance(self.image, str) or re.search(r"\s", self.image):
            raise ConfigError(f"image must be a container image reference without spaces, got {self.image!r}")
        if not self.name:
            _set(self, "name", f"tpuray-{topo.pod_type}")
        limit = MAX_NAME_LENGTH[kind]
        if not _DNS1035.match(self.name) or len(self.name) > limit:
            raise ConfigError(
                f"name {self.name!r} is not valid for a {kind}: use lower-case letters, digits and '-', "
                f"starting with a letter, ending with a letter or digit, at most {limit} characters"
            )
        if self.namespace is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace):
            raise ConfigError(f"namespace {self.namespace!r} is not a valid Kubernetes namespace name")
        for key in ("head_cpu", "head_memory", "worker_cpu", "worker_memory"):
            value = getattr(self, key)
            if not isinstance(value, str) or not _QUANTITY.match(value) or value.startswith("-"):
                raise ConfigError(
                    f"{key}={value!r} is not a Kubernetes quantity; valid: e.g. '8', '500m', '32Gi'"
                )
        self._check_kind_fields()
        self._check_capacity()

    def _check_slices(self) -> None:
        if self.autoscale is None:
            check_positive_int("num_slices", self.num_slices)
            return
        if not isinstance(self.autoscale, AutoscaleConfig):
            raise ConfigError(f"autoscale must be an AutoscaleConfig or None, got {self.autoscale!r}")
        self.autoscale.check_replicas(self.num_slices)
        self.autoscale.check_hosts(self.slice_topology.num_hosts)

    @property
    def max_slices(self) -> int:
        """The most slices the cluster can have: the autoscaler's bound, else the fixed count."""
        return self.autoscale.max_slices if self.autoscale else self.num_slices

    def _check_capacity(self) -> None:
        if not isinstance(self.spot, bool):
            raise ConfigError(f"spot must be True or False, got {self.spot!r}")
        if self.reservation is None:
            return
        if not isinstance(self.reservation, str) or not _GCE_NAME.match(self.reservation):
            raise ConfigError(
                f"reservation {self.reservation!r} is not a GCE reservation name: lower-case letters, digits "
                "and '-', starting with a letter, at most 63 characters"
            )
        if self.spot:
            raise ConfigError(
                f"spot=True and reservation={self.reservation!r} exclude each other: a node pool takes spot "
                "capacity or a specific reservation; choose one"
            )

    def capacity_node_selector(self) -> dict[str, str]:
        """The GKE node selector for the TPU hosts' capacity (spot / a reservation / on-demand)."""
        if self.spot:
            return {GKE_SPOT_LABEL: "true"}
        if self.reservation:
            return {GKE_RESERVATION_LABEL: self.reservation, GKE_RESERVATION_AFFINITY_LABEL: "specific"}
        return {}

    def _check_kind_fields(self) -> None:
        kind = self.kind
        if kind == "RayJob" and not (self.entrypoint and self.entrypoint.strip()):
            raise ConfigError("a RayJob needs an entrypoint, e.g. entrypoint='python train.py'")
        if kind != "RayJob" and self.entrypoint:
            raise ConfigError(f"entrypoint is only used by kind RayJob, not {kind}")
        if kind == "RayService":
            if self.serve_config is None and not self.model:
                raise ConfigError(
                    "a RayService needs serve_config (a Ray Serve config or build_openai_app args) "
                    "or model (a model id or path to serve with tpuray.serve.llm)"
                )
            if self.serve_config is not None:
                sc = self.serve_config
                if not isinstance(sc, Mapping) or not ("applications" in sc or "llm_configs" in sc):
                    raise ConfigError(
                        "serve_config must be a mapping with 'applications' (Ray Serve config) or "
                        f"'llm_configs' (build_openai_app args), got {type(sc).__name__} with keys "
                        f"{sorted(sc) if isinstance(sc, Mapping) else '-'}"
                    )
                if "applications" in sc and self.runtime_env:
                    raise ConfigError(
                        "runtime_env is not applied to a full Ray Serve config; set runtime_env in its "
                        "applications instead"
                    )
                self._check_serve_config(sc)
        elif self.serve_config is not None or self.model:
            raise ConfigError(f"serve_config / model are only used by kind RayService, not {kind}")
        if self.runtime_env is not None and not isinstance(self.runtime_env, Mapping):
            raise ConfigError(f"runtime_env must be a mapping, got {self.runtime_env!r}")
        if kind == "RayCluster" and self.runtime_env:
            raise ConfigError(
                "runtime_env is used by RayJob / RayService; a RayCluster's image must already contain "
                "your dependencies"
            )

    def _check_serve_config(self, sc: Mapping[str, Any]) -> None:
        """tpuray.serve.llm apps must validate, and ask for slices this cluster has."""
        if "llm_configs" in sc:
            self._check_llm_args(sc, "serve_config")
            return
        for i, app in enumerate(sc.get("applications") or []):
            if isinstance(app, Mapping) and str(app.get("import_path", "")).startswith("tpuray.serve.llm:"):
                self._check_llm_args(app.get("args") or {}, f"serve_config applications[{i}].args")

    def _check_llm_args(self, args: Mapping[str, Any], where: str) -> None:
        from tpuray.serve.llm.config import LLMServingArgs

        for c in args.get("llm_configs") or []:
            if not isinstance(c, Mapping):
                raise ConfigError(
                    f"{where}: llm_configs entries must be inline mappings in a RayService (a file path "
                    f"would not exist in the pods), got {c!r}"
                )
        try:
            parsed = LLMServingArgs(**args)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from e
        topo, replicas = self.slice_topology, 0
        for c in parsed.llm_configs:
            if c.topology is None:
                continue  # a CPU replica
            if c.topology.pod_type != topo.pod_type:
                raise ConfigError(
                    f"{where}: model {c.model_id!r} asks for {c.topology.pod_type} ({c.topology.topology}) "
                    f"slices but this cluster has {topo.pod_type} ({topo.topology}) slices"
                )
            n = c.deployment_config.get("num_replicas", 1)
            replicas += n if isinstance(n, int) else 1
        if replicas > self.max_slices:
            bound = f"max_slices={self.max_slices}" if self.autoscale else f"num_slices={self.num_slices}"
            raise ConfigError(f"{where}: the TPU replicas need {replicas} slices (one each) but {bound}")

    @property
    def gke_accelerator(self) -> str:
        return gke_accelerator(self.slice_topology)

    @property
    def worker_group_name(self) -> str:
        return f"tpu-{self.slice_topology.pod_type}"

    def host_transfer_env(self) -> list[tuple[str, str]]:
        """libtpu's premapped host buffer for each chip's process in a TPU pod (TPU_HOST_TRANSFER_ENV),
        its size capped at a quarter of that process's share of `worker_memory` (the buffer is pinned
        host memory, counted against the pod's limit) and rounded down to a power of two; nothing where
        the cap falls under 256 MiB (tpuray then warns in each process)."""
        share = quantity_bytes(self.worker_memory) // self.slice_topology.chips_per_host // 4
        cap = 1 << (share.bit_length() - 1) if share > 0 else 0
        if cap < MIN_PREMAPPED_BYTES:
            return []
        return [(name, str(min(int(value), cap))) for name, value in TPU_HOST_TRANSFER_ENV]

    def describe(self) -> str:
        t = self.slice_topology
        return (
            f"{self.kind} {self.name}: {self.num_slices} x TPU {t.generation.family} {t.topology} slice "
            f"({t.pod_type}) = {self.num_slices * t.num_hosts} host pod(s) x {t.chips_per_host} chips "
            f"({self.num_slices * t.num_chips} chips), GKE {self.gke_accelerator}"
            + (
                " on spot VMs"
                if self.spot
                else f" on reservation {self.reservation}"
                if self.reservation
                else ""
            )
            + (f", {self.autoscale.describe()}" if self.autoscale else "")
        )
