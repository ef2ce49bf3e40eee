"""Slices on demand for the emulator: the config that hands Ray's own autoscaler whole emulated slices.

`EmulatedCluster(autoscale=True, max_slices={("TPU-V6E", "4x4"): 2})` starts its head with this config as
Ray's `--autoscaling-config`: Ray starts its autoscaler (the v1 `StandardAutoscaler`, in Ray's monitor
process on the head) and loads `tpuray.emulator.slice_provider.EmulatedSliceProvider`, whose node types are
whole slices. One autoscaler "node" is one slice: one launch starts every host of it (their specs come from
`tpuray.emulator.spec.host_specs`, as for hand-started slices), one termination stops every host of it.

A node type advertises the slice's head resource ("TPU-v6e-16-head", the one resource Ray's and tpuray's
SlicePlacementGroup ask for first) and the accelerator-type resource; a single-host type also its host's
chips and CPUs, what Ray's own single-host requests ask for (they have no head bundle). Demand for a
multi-host slice is therefore a pending head bundle; demand for chips of a named multi-host slice (the
second placement group of a reservation) is never a reason to start a multi-host slice.

The provider publishes its node types and the slices it runs as `tpuray.slices.autoscaler` defines them
(the contract `tpuray status` and `SlicePlacementGroup` read, to show them and to fail fast).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpuray.constants import (
    ACCELERATOR_LABEL,
    POD_TYPE_LABEL,
    TPU_RESOURCE,
    WORKER_ID_LABEL,
    accelerator_resource,
)
from tpuray.emulator.spec import SliceRequest
from tpuray.slices.autoscaler import SliceNodeType
from tpuray.validation import ConfigError, check_positive_int, is_number

HEAD_NODE_TYPE = "ray.head.default"
PROVIDER_MODULE = "tpuray.emulator.slice_provider.EmulatedSliceProvider"
# Seconds between two rounds of Ray's monitor (Ray reads AUTOSCALER_UPDATE_INTERVAL_S as an integer).
UPDATE_INTERVAL_ENV = "AUTOSCALER_UPDATE_INTERVAL_S"
# Ray's knob for a node's id (what Ray's fake multi-node provider sets): autoscaler nodes map to Ray nodes.
NODE_ID_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"

SliceKey = tuple[str, str]  # (accelerator type, topology)


def node_type_name(request: SliceRequest) -> str:
    """The autoscaler node type of one slice shape: "tpu-v6e-16" (the pod type says type and size)."""
    return f"tpu-{request.slice_topology.pod_type}"


@dataclass(frozen=True)
class AutoscaleSpec:
    """What Ray's autoscaler may start: at most `max_slices[(type, topology)]` slices of each shape, each
    stopped once all its hosts have been idle `idle_timeout_s`; Ray's monitor runs a round every
    `update_interval_s` (whole seconds, Ray's knob)."""

    max_slices: Mapping[SliceKey, int]
    idle_timeout_s: float = 60.0
    update_interval_s: int = 1
    requests: tuple[SliceRequest, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_slices, Mapping) or not self.max_slices:
            raise ConfigError(
                "autoscale=True needs max_slices={(accelerator type, topology): N, ...}, e.g. "
                f"{{('TPU-V6E', '4x4'): 2}}; got {self.max_slices!r}"
            )
        requests: list[SliceRequest] = []
        for key, count in self.max_slices.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ConfigError(f"max_slices key {key!r} must be (accelerator type, topology)")
            requests.append(SliceRequest(key[0], key[1], count))  # validates shape and count
        names = [node_type_name(r) for r in requests]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"max_slices names the same slice shape twice: {dup}")
        if not is_number(self.idle_timeout_s) or self.idle_timeout_s < 0:
            raise ConfigError(f"idle_timeout_s={self.idle_timeout_s!r} is invalid: use seconds >= 0")
        check_positive_int("update_interval_s", self.update_interval_s)
        object.__setattr__(self, "requests", tuple(requests))

    def node_types(self, cpus_per_chip: int) -> dict[str, dict[str, Any]]:
        """Ray's `available_node_types` entries of the slice shapes (the head's is added by the caller).

        Every type offers the slice's head resource and its accelerator-type resource. A single-host type
        also offers its host's chips and CPUs: Ray's own `ray.util.tpu.SlicePlacementGroup` reserves a
        single-host slice with no head bundle and no label selector, as one bundle `{"TPU": chips, "CPU":
        1}` (plus `accelerator_type:TPU-V6E` under Ray Train), and a v1 autoscaler node type must offer
        those resources for Ray to start one (see docs/autoscaling.md). A multi-host type offers no
        chips: the hosts' bundles of a multi-host reservation are bound to a named slice by label, which
        Ray's v1 autoscaler ignores, so chips there must never start a slice."""
        types: dict[str, dict[str, Any]] = {}
        for req in self.requests:
            topo = req.slice_topology
            accel = topo.generation.accelerator_type
            resources: dict[str, float] = {topo.head_resource: 1, accelerator_resource(accel): 1}
            if topo.num_hosts == 1:
                resources.update(
                    {TPU_RESOURCE: topo.chips_per_host, "CPU": cpus_per_chip * topo.chips_per_host}
                )
            types[node_type_name(req)] = {
                "node_config": {"accelerator_type": accel, "topology": topo.topology},
                "resources": resources,
                "labels": {WORKER_ID_LABEL: "0", POD_TYPE_LABEL: topo.pod_type, ACCELERATOR_LABEL: accel},
                "min_workers": 0,
                "max_workers": req.count,
            }
        return types

    def describe(self) -> str:
        return ", ".join(
            f"{node_type_name(r)} ({r.slice_topology.generation.accelerator_type} {r.slice_topology.topology}"
            f", {r.slice_topology.num_hosts} host(s)) x {r.count}"
            for r in self.requests
        )


def parse_max_slices(items: list[str]) -> dict[SliceKey, int]:
    """`TYPE:TOPOLOGY=N` strings (the CLI's --max-slices) to `max_slices`."""
    out: dict[SliceKey, int] = {}
    for item in items:
        shape, sep, count = item.partition("=")
        accel, sep2, topology = shape.partition(":")
        if not (sep and sep2 and count.strip().isdigit() and accel and topology):
            raise ConfigError(f"--max-slices {item!r} is invalid: use TYPE:TOPOLOGY=N, e.g. TPU-V6E:4x4=2")
        key = (accel.strip(), topology.strip())
        if key in out:
            raise ConfigError(f"--max-slices {item!r} names {shape.strip()!r} again: give each shape once")
        out[key] = int(count)
    return out


def ray_autoscaling_config(
    spec: AutoscaleSpec, head_cpus: int, provider: dict[str, Any], cluster_name: str = "tpuray-emulated"
) -> dict[str, Any]:
    """The whole config Ray's monitor loads (what `ray start --autoscaling-config` would read)."""
    types = spec.node_types(int(provider["cpus_per_chip"]))
    types[HEAD_NODE_TYPE] = {"node_config": {}, "resources": {"CPU": head_cpus}, "max_workers": 0}
    return {
        "cluster_name": cluster_name,
        "max_workers": sum(r.count for r in spec.requests),
        # Ray counts idleness in minutes; a float keeps the seconds.
        "idle_timeout_minutes": spec.idle_timeout_s / 60.0,
        # Every pending slice starts in the same round (Ray's default grows the cluster step by step).
        "upscaling_speed": float(max(1, sum(r.count for r in spec.requests))),
        "provider": {
            "type": "external",
            "module": PROVIDER_MODULE,
            # Every emulated host is on this machine: the autoscaler tells them apart by Ray node id.
            "use_node_id_as_ip": True,
            # No ssh set-up (the provider starts ready raylets), no config-drift restarts, and no
            # host-by-host health kills: the provider takes a slice with a dead host down as a whole.
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "worker_liveness_check": False,
            **provider,
        },
        "auth": {},
        "available_node_types": types,
        "head_node_type": HEAD_NODE_TYPE,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def autoscaling_head(
    spec: AutoscaleSpec, head_cpus: int, provider: dict[str, Any], config_dir: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """How to start the head of an autoscaling cluster: (env of the starting process, which Ray's monitor
    inherits; head node arguments). Writes Ray's autoscaling config under `config_dir`; `provider` holds
    the host settings of EmulatedSliceProvider."""
    import ray._private.services as services
    from ray import NodeID

    head_id = NodeID.from_random().hex()
    provider = {
        **provider,
        "head_node_id": head_id,
        "host_ip": services.get_node_ip_address(),
        "slice_types": {t.name: t.to_json() for t in slice_types(spec)},
    }
    path = os.path.join(config_dir, "autoscaling.json")
    with open(path, "w") as f:
        json.dump(ray_autoscaling_config(spec, head_cpus, provider), f)
    # Ray's v1 autoscaler (see docs/autoscaling.md), a round every update_interval_s.
    env = {UPDATE_INTERVAL_ENV: str(spec.update_interval_s), "RAY_enable_autoscaler_v2": "0"}
    return env, {"env_vars": {NODE_ID_ENV: head_id}, "autoscaling_config": path}


def slice_types(spec: AutoscaleSpec) -> list[SliceNodeType]:
    """The node types the provider publishes (`tpuray.slices.autoscaler.NODE_TYPES_KEY`)."""
    return [
        SliceNodeType(
            name=node_type_name(r),
            accelerator_type=r.slice_topology.generation.accelerator_type,
            topology=r.slice_topology.topology,
            pod_type=r.slice_topology.pod_type,
            max_slices=r.count,
        )
        for r in spec.requests
    ]
