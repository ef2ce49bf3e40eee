"""`AutoscaleConfig`: Ray's in-tree autoscaler on a KubeRay TPU worker group, counted in whole slices.

What the manifest gets (KubeRay v1.7 RayCluster API, `ray-operator/apis/ray/v1/raycluster_types.go`):
`spec.enableInTreeAutoscaling: true`, `spec.autoscalerOptions` (`version`, `idleTimeoutSeconds`,
`upscalingMode`), and on the TPU worker group `minReplicas` / `maxReplicas` in slices. One replica is one
slice of `numOfHosts` pods: Ray's KubeRay autoscaler multiplies both bounds by `numOfHosts` to get hosts
(`ray.autoscaler._private.kuberay.autoscaling_config`), the v2 autoscaler divides its host count back by
`numOfHosts` when it patches `replicas`, and a pod it lists in `workersToDelete` makes KubeRay delete that
pod's whole replica, so slices come and go whole (its idle timeout counts host by host: see
docs/autoscaling-k8s.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpuray.validation import ConfigError, canonical_choice, check_choice, is_int

AUTOSCALER_VERSIONS = ("v1", "v2")
# KubeRay's enum (+kubebuilder:validation:Enum=Default;Aggressive;Conservative).
UPSCALING_MODES = ("Default", "Aggressive", "Conservative")
INT32_MAX = 2**31 - 1  # minReplicas / maxReplicas / idleTimeoutSeconds are int32 in the CRD


def check_count(name: str, value: Any) -> int:
    """A replica count or a number of seconds the CRD can hold: an int in 0 .. 2**31-1."""
    if not is_int(value) or not 0 <= value <= INT32_MAX:
        raise ConfigError(f"{name}={value!r} is invalid: use an integer >= 0 (at most {INT32_MAX})")
    return value


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds in slices and the autoscaler's options. `idle_timeout_s` / `upscaling_mode` left None
    keep Ray's defaults (60 s; not rate-limited)."""

    min_slices: int = 0
    max_slices: int = 1
    idle_timeout_s: int | None = None
    upscaling_mode: str | None = None
    version: str = "v2"

    def __post_init__(self) -> None:
        check_count("min_slices", self.min_slices)
        check_count("max_slices", self.max_slices)
        if self.max_slices == 0:
            raise ConfigError(
                "max_slices=0 leaves the autoscaler no slice to add (maxReplicas 0): use max_slices >= 1, "
                "or drop autoscaling for a group that stays empty"
            )
        if self.min_slices > self.max_slices:
            raise ConfigError(
                f"min_slices={self.min_slices} is greater than max_slices={self.max_slices}; "
                "KubeRay rejects minReplicas > maxReplicas"
            )
        if self.idle_timeout_s is not None:
            check_count("idle_timeout_s", self.idle_timeout_s)
        if self.upscaling_mode is not None:
            object.__setattr__(
                self,
                "upscaling_mode",
                canonical_choice("upscaling_mode", self.upscaling_mode, UPSCALING_MODES),
            )
        check_choice("autoscaler version", self.version, AUTOSCALER_VERSIONS)

    def check_hosts(self, num_hosts: int) -> None:
        """Refuse the v1 autoscaler on multi-host slices: its KubeRay provider counts pods as replicas
        (`BatchingNodeProvider.cur_num_workers` -> `replicas`), so a 4-host slice would be patched to 4
        replicas = 4 slices. The v2 provider divides by numOfHosts."""
        if self.version == "v1" and num_hosts > 1:
            raise ConfigError(
                f"autoscaler version 'v1' cannot scale slices of {num_hosts} hosts: Ray's v1 KubeRay provider "
                "counts pods as replicas (numOfHosts ignored); use version 'v2' (valid for multi-host: v2)"
            )

    def check_replicas(self, num_slices: Any) -> None:
        """The initial slice count must lie within the bounds (KubeRay: min <= replicas <= max)."""
        check_count("num_slices", num_slices)
        if not self.min_slices <= num_slices <= self.max_slices:
            raise ConfigError(
                f"num_slices={num_slices} (initial replicas) is outside min_slices={self.min_slices} .. "
                f"max_slices={self.max_slices}"
            )

    def autoscaler_options(self) -> dict[str, Any]:
        """`spec.autoscalerOptions`: only what was chosen, so Ray's defaults stay Ray's."""
        out: dict[str, Any] = {"version": self.version}
        if self.idle_timeout_s is not None:
            out["idleTimeoutSeconds"] = self.idle_timeout_s
        if self.upscaling_mode is not None:
            out["upscalingMode"] = self.upscaling_mode
        return out

    def describe(self) -> str:
        return f"autoscaled {self.min_slices}..{self.max_slices} slices (autoscaler {self.version})"
