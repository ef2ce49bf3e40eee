"""What an autoscaler of whole slices publishes, and how tpuray reads it.

The contract between an autoscaler whose nodes are whole TPU slices (the emulator's
`EmulatedSliceProvider` implements it) and the code that reserves slices. The autoscaler publishes two
JSON values in the GCS KV store, namespace KV_NAMESPACE:

- NODE_TYPES_KEY: the slice shapes it can start, `{node type: SliceNodeType.to_json()}`, once at start;
- SLICES_KEY: the slices it runs now, `{slice name: AutoscaledSlice}`, at every change.

`tpuray status`, a slice reservation (demand.py: one that no node type can ever satisfy fails at once)
and `build_openai_app` read them here, so none of them imports the emulator.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

KV_NAMESPACE = "tpuray"
NODE_TYPES_KEY = "emulator/autoscale-node-types"  # {node type: SliceNodeType.to_json()}
SLICES_KEY = "emulator/autoscaled-slices"  # {slice name: AutoscaledSlice}

SliceState = Literal["starting", "up", "stopping"]


@dataclass(frozen=True)
class SliceNodeType:
    """One slice shape the autoscaler can start: at most `max_slices` slices of it."""

    name: str  # the autoscaler's node type, e.g. "tpu-v6e-16"
    accelerator_type: str
    topology: str
    pod_type: str
    max_slices: int

    def to_json(self) -> dict[str, Any]:
        """What NODE_TYPES_KEY holds under the type's name."""
        value = asdict(self)
        del value["name"]
        return value

    @classmethod
    def from_json(cls, name: str, value: Mapping[str, Any]) -> SliceNodeType:
        return cls(name=name, **value)

    def describe(self) -> str:
        return f"{self.name} ({self.accelerator_type} {self.topology}, at most {self.max_slices})"


class AutoscaledSlice(TypedDict):
    """One slice the autoscaler runs (SLICES_KEY's values)."""

    node_type: str
    state: SliceState
    node_ids: list[str]  # the Ray node ids of its hosts, by worker id
    hosts_up: int
    hosts: int
    pids: list[int]  # every process of its hosts
    raylet_pids: dict[str, int]  # Ray node id -> the pid of its raylet
    created_at: float
    error: str  # why it failed to start, else ""


def encode(value: Any) -> bytes:
    """A published value as it is written to the KV store."""
    return json.dumps(value).encode()


def _kv_get(key: str, gcs_address: str | None = None) -> Any:
    """A published value: through this process's Ray connection, or straight from `gcs_address`."""
    if gcs_address is not None:
        import ray._raylet

        raw = ray._raylet.GcsClient(address=gcs_address).internal_kv_get(
            key.encode(), KV_NAMESPACE.encode(), timeout=10
        )
    else:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        if not _internal_kv_initialized():
            return None
        raw = _internal_kv_get(key, namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None


def published_node_types(gcs_address: str | None = None) -> list[SliceNodeType] | None:
    """The slice shapes the cluster's autoscaler can start, or None when no slice autoscaler runs."""
    types = _kv_get(NODE_TYPES_KEY, gcs_address)
    if types is None:
        return None
    return [SliceNodeType.from_json(name, value) for name, value in types.items()]


def published_slices(gcs_address: str | None = None) -> dict[str, AutoscaledSlice]:
    """The slices the cluster's autoscaler runs now, by name ({} when none, or no autoscaler)."""
    return _kv_get(SLICES_KEY, gcs_address) or {}


def ray_autoscaler_runs() -> bool:
    """Whether Ray's own autoscaler can add nodes to this cluster (requires ray.init()): its v2 (KubeRay's
    in-tree autoscaler: the v2 flag in the GCS), or its v1 monitor with a node provider. A cluster of nodes
    started by hand runs the v1 monitor read-only, which names each node's type after the node itself
    (`node_<id>`): no type there can bring a new node."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        if is_autoscaler_v2(fetch_from_server=True):
            return True
    except Exception:  # noqa: BLE001 - no answer from the GCS: read the v1 monitor's report below
        pass
    raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    report = (json.loads(raw) if raw else {}).get("autoscaler_report") or {}
    mapping: dict[str, str] = report.get("node_type_mapping") or {}
    return any(node_type != f"node_{node_id}" for node_id, node_type in mapping.items())
