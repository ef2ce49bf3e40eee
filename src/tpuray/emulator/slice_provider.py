"""EmulatedSliceProvider: a Ray autoscaler NodeProvider whose nodes are whole emulated TPU slices.

Loaded by Ray's monitor process on the head of an autoscaling `EmulatedCluster` (see
`tpuray.emulator.autoscale`). Ray's StandardAutoscaler decides (pending head bundles -> slices to launch;
idle slices -> terminations); this provider only carries its decisions out, a slice at a time:

- `create_node` starts every host of a new slice (specs from `tpuray.emulator.spec.host_specs`), worker 0
  last: the slice's head resource, the one a reservation waits for, appears only once all its hosts are up.
- `terminate_node` stops every host of the slice.
- The autoscaler sees one address per slice (`internal_ip`): that of its most recently busy host, so the
  slice counts as idle only once every host has been idle for `idle_timeout_minutes`.
- A slice with a dead host (killed, preempted) is no slice: `non_terminated_nodes` stops its other hosts
  and drops it; the autoscaler then starts a replacement for any pending work.

Like Ray's own fake multi-node provider, it gives each host a known Ray node id
(RAY_OVERRIDE_NODE_ID_FOR_TESTING), so autoscaler nodes and Ray nodes match without IP addresses.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from tpuray.emulator.autoscale import HEAD_NODE_TYPE, NODE_ID_ENV
from tpuray.emulator.hosts import start_host
from tpuray.emulator.spec import HostSpec, host_specs
from tpuray.slices.autoscaler import (
    KV_NAMESPACE,
    NODE_TYPES_KEY,
    SLICES_KEY,
    AutoscaledSlice,
    SliceState,
    encode,
)
from tpuray.topology import SliceTopology

logger = logging.getLogger(__name__)


def _new_node_id() -> str:
    from ray import NodeID

    return NodeID.from_random().hex()


@dataclass
class _Slice:
    name: str
    node_type: str
    hosts: list[HostSpec]
    node_ids: list[str]  # by worker id, known before the hosts start
    tags: dict[str, str]
    state: SliceState = "starting"  # starting -> up -> stopping
    created_at: float = field(default_factory=time.time)
    nodes: dict[int, Any] = field(default_factory=dict)  # worker id -> ray._private.node.Node
    error: str = ""

    def raylet_pids(self) -> dict[str, int]:
        from ray._private import ray_constants

        return {
            self.node_ids[w]: node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
            for w, node in self.nodes.items()
        }

    def pids(self) -> list[int]:
        return [
            info.process.pid
            for node in self.nodes.values()
            for infos in node.all_processes.values()
            for info in infos
        ]

    def published(self) -> AutoscaledSlice:
        return {
            "node_type": self.node_type,
            "state": self.state,
            "node_ids": list(self.node_ids),
            "hosts_up": len(self.nodes),
            "hosts": len(self.hosts),
            "pids": self.pids(),
            "raylet_pids": self.raylet_pids(),
            "created_at": self.created_at,
            "error": self.error,
        }


class _Joiner:
    """Starts one worker raylet that joins the head's GCS (what Cluster.add_node does for a worker)."""

    def __init__(self, gcs_address: str) -> None:
        self.gcs_address = gcs_address

    def add_node(self, **node_args: Any) -> Any:
        import ray._private.node as ray_node
        import ray._private.services as services
        from ray._private.parameter import RayParams

        params = RayParams(
            gcs_address=self.gcs_address,
            include_log_monitor=False,
            num_gpus=0,
            node_manager_port=0,
            min_worker_port=0,
            max_worker_port=0,
            dashboard_agent_listen_port=None,
            **node_args,
        )
        # spawn_reaper: the hosts share the fate of this (monitor) process, as hand-started ones share the
        # driver's; shutdown_at_exit=False: their lifetime is the provider's.
        node = ray_node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
        services.wait_for_node(node.gcs_address, node.plasma_store_socket_name, 30)
        return node


class EmulatedSliceProvider(NodeProvider):
    """Ray autoscaler node provider: one node = one whole emulated TPU slice (see module doc)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        from ray.experimental.internal_kv import internal_kv_get_gcs_client

        super().__init__(provider_config, cluster_name)
        self._lock = threading.RLock()
        self._gcs = internal_kv_get_gcs_client()  # Ray's monitor set it up before loading providers
        self._joiner = _Joiner(self._gcs.address)
        self._head_node_id: str = provider_config["head_node_id"]
        self._host_env: dict[str, str] = dict(provider_config["host_env"])
        self._host_ip: str = provider_config["host_ip"]
        self._cpus_per_chip: int = int(provider_config["cpus_per_chip"])
        self._memory: int = int(provider_config["host_memory_bytes"])
        self._object_store: int = int(provider_config["object_store_bytes"])
        self._prefix: str = provider_config["name_prefix"]
        self._types: dict[str, dict[str, Any]] = dict(provider_config["slice_types"])
        self._slices: dict[str, _Slice] = {}
        self._counter = itertools.count()
        self._head_tags = {
            TAG_RAY_NODE_KIND: NODE_KIND_HEAD,
            TAG_RAY_USER_NODE_TYPE: HEAD_NODE_TYPE,
            TAG_RAY_NODE_NAME: "head",
            TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
        }
        self._busiest: dict[str, str] = {}  # slice name -> node id of its most recently busy host
        # Ray ties a node's processes to the thread that started them (PR_SET_PDEATHSIG): one long-lived
        # thread starts and stops every host.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-slice-start")
        self._kv_put(NODE_TYPES_KEY, self._types)
        self._publish()

    # -- what the autoscaler reads --------------------------------------------------------------

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        self._refresh()
        with self._lock:
            ids = ["head", *(s.name for s in self._slices.values() if s.state != "stopping")]
        return [i for i in ids if all(self.node_tags(i).get(k) == v for k, v in tag_filters.items())]

    def is_running(self, node_id: str) -> bool:
        return node_id == "head" or node_id in self._slices

    def is_terminated(self, node_id: str) -> bool:
        return not self.is_running(node_id)

    def node_tags(self, node_id: str) -> dict[str, str]:
        if node_id == "head":
            return self._head_tags
        with self._lock:
            sl = self._slices.get(node_id)
            return dict(sl.tags) if sl else {}

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self._lock:
            if node_id in self._slices:
                self._slices[node_id].tags.update(tags)

    def internal_ip(self, node_id: str) -> str:
        if node_id == "head":
            return self._head_node_id
        with self._lock:
            sl = self._slices[node_id]
            return self._busiest.get(sl.name, sl.node_ids[0])

    def external_ip(self, node_id: str) -> str:
        return self.internal_ip(node_id)

    # -- what the autoscaler decides --------------------------------------------------------------

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> None:
        node_type = tags[TAG_RAY_USER_NODE_TYPE]
        topo = SliceTopology.parse(node_config["accelerator_type"], node_config["topology"])
        for _ in range(count):
            name = f"{self._prefix}-{topo.pod_type}-{next(self._counter)}"
            hosts = host_specs(topo, name, self._host_ip, self._cpus_per_chip, self._memory)
            all_tags = {
                **tags,
                TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                TAG_RAY_USER_NODE_TYPE: node_type,
                TAG_RAY_NODE_NAME: name,
                TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
            }
            sl = _Slice(name, node_type, hosts, [_new_node_id() for _ in hosts], all_tags)
            with self._lock:
                self._slices[name] = sl
            logger.info("autoscaler: starting slice %s (%s, %d host(s))", name, node_type, len(hosts))
            self._starter.submit(self._start_slice, sl)
        self._publish()

    def terminate_node(self, node_id: str) -> None:
        with self._lock:
            sl = self._slices.get(node_id)
            if sl is None or sl.state == "stopping":
                return
            sl.state = "stopping"
        logger.info("autoscaler: stopping slice %s (all %d host(s))", sl.name, len(sl.hosts))
        self._publish()
        self._starter.submit(self._stop_slice, sl)

    # -- slice lifecycle (on the starter thread) -------------------------------------------------

    def _start_slice(self, sl: _Slice) -> None:
        # Worker 0 last: its head resource says "this slice is whole" to anyone reserving it.
        for worker_id in reversed(range(len(sl.hosts))):
            if sl.state == "stopping":
                break
            host = sl.hosts[worker_id]
            env = {**self._host_env, NODE_ID_ENV: sl.node_ids[worker_id]}
            try:
                sl.nodes[worker_id] = start_host(self._joiner, host, env, self._object_store)
            except Exception as e:  # none or all: a slice that cannot start whole is stopped
                logger.error("autoscaler: slice %s host %d failed to start: %s", sl.name, worker_id, e)
                sl.error = str(e)
                self._stop_slice(sl)
                return
            with self._lock:
                if worker_id == 0 and sl.state == "starting":
                    sl.state = "up"
            self._publish()

    def _stop_slice(self, sl: _Slice) -> None:
        sl.state = "stopping"
        for node in sl.nodes.values():
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        sl.nodes.clear()
        with self._lock:
            self._slices.pop(sl.name, None)
            self._busiest.pop(sl.name, None)
        logger.info("autoscaler: slice %s stopped", sl.name)
        self._publish()

    # -- the hosts as Ray sees them ---------------------------------------------------------------

    def _refresh(self) -> None:
        """Read every node's state from the GCS: a slice with a dead host goes down whole; each slice's
        address for the autoscaler is that of its most recently busy live host."""
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        from ray.core.generated.autoscaler_pb2 import NodeStatus

        states = {n.node_id.hex(): n for n in get_cluster_resource_state(self._gcs).node_states}
        broken: list[_Slice] = []
        with self._lock:
            for sl in self._slices.values():
                if sl.state != "up":
                    continue
                seen = [states.get(i) for i in sl.node_ids]
                if any(s is None or s.status == NodeStatus.DEAD for s in seen):
                    broken.append(sl)
                    continue
                # Worker 0 first among equals: ties keep the slice's address stable.
                idle = [s.idle_duration_ms for s in seen]  # type: ignore[union-attr]
                self._busiest[sl.name] = sl.node_ids[idle.index(min(idle))]
        for sl in broken:
            with self._lock:
                if sl.state != "up":
                    continue
                sl.state = "stopping"
            logger.warning("autoscaler: slice %s lost a host; stopping all its hosts", sl.name)
            self._starter.submit(self._stop_slice, sl)
        if broken:
            self._publish()

    def _publish(self) -> None:
        with self._lock:
            data = {s.name: s.published() for s in self._slices.values()}
        self._kv_put(SLICES_KEY, data)

    def _kv_put(self, key: str, value: Any) -> None:
        try:
            self._gcs.internal_kv_put(key.encode(), encode(value), True, KV_NAMESPACE.encode(), timeout=5)
        except Exception as e:  # status display only; the autoscaler must not stop for it
            logger.warning("could not publish %s: %s", key, e)
