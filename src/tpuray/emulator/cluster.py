"""EmulatedCluster: a local Ray cluster whose nodes are emulated TPU hosts.

Each emulated host is a real raylet (ray.cluster_utils.Cluster.add_node) with the resources, labels and
environment of a real GKE/KubeRay TPU host. Ray's own TPU detection runs on each node while its host
env is in place, so resources and labels come out exactly as Ray computes them on real TPU VMs; the
node also carries `tpuray.io/emulated=true` and `TPURAY_EMULATION=1` (in every worker's env).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from tpuray.constants import ROLE_LABEL
from tpuray.emulator.autoscale import AutoscaleSpec, autoscaling_head
from tpuray.emulator.hosts import (
    _GCS_SYSTEM_CONFIG,
    _add_node_with_retry,
    _host_environ,
    _kill_pids,
    _refuse_on_real_tpu,
    _torch_tpu_env,
    _vllm_env,
    start_host,
)
from tpuray.emulator.spec import (
    SLICE_CORES,
    EmulatedSlice,
    HostSpec,
    SliceCores,
    SliceRequest,
    plan_slices,
    split_cores,
)
from tpuray.slices.autoscaler import AutoscaledSlice, published_slices
from tpuray.validation import ConfigError, check_choice, check_positive_int

logger = logging.getLogger(__name__)


class EmulatedCluster:
    """Local Ray cluster: a CPU-only head node (drivers, Serve) plus emulated TPU hosts.

    with EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=4) as cluster:
        cluster.connect()           # or ray.init(address=cluster.address)
        cluster.slices              # [EmulatedSlice(name, topology, hostnames, node_ids), ...]

    `cores`: where the hosts' processes compute (`tpuray.emulator.spec.SliceCores`): "shared" (every core)
    or "per_slice" (each slice on cores of its own, as a real slice on its own chips; Linux only, slices
    started by hand only, at most one slice per core). `include_dashboard`: Ray's dashboard on the head
    (`dashboard_url`), which Ray's own tools need (`ray list actors`, `serve status`); off by default here
    (tests), on by default for `tpuray emulate up`.
    """

    def __init__(
        self,
        slices: Sequence[SliceRequest],
        head_cpus: int = 4,
        cpus_per_chip: int = 2,
        host_memory_gb: float = 4.0,
        object_store_mb: int = 128,
        name_prefix: str = "emulated",
        connect: bool = False,
        include_dashboard: bool = False,
        autoscale: bool = False,
        max_slices: Mapping[tuple[str, str], int] | None = None,
        idle_timeout_s: float | None = None,
        cores: SliceCores = "shared",
    ) -> None:
        if isinstance(slices, SliceRequest):
            slices = [slices]
        self.requests: list[SliceRequest] = list(slices)
        # Slices on demand (Ray's autoscaler; tpuray.emulator.autoscale): None = a fixed cluster.
        self.autoscale: AutoscaleSpec | None = None
        if autoscale:
            self.autoscale = AutoscaleSpec(
                max_slices or {}, 60.0 if idle_timeout_s is None else idle_timeout_s
            )
        elif max_slices is not None or idle_timeout_s is not None:
            raise ConfigError("max_slices and idle_timeout_s are only valid with autoscale=True")
        check_positive_int("head_cpus", head_cpus, minimum=0)
        if host_memory_gb <= 0:
            raise ConfigError(f"host_memory_gb must be > 0, got {host_memory_gb}")
        if object_store_mb < 75:
            raise ConfigError(f"object_store_mb must be >= 75 (Ray's minimum), got {object_store_mb}")
        self.head_cpus = head_cpus
        self.cpus_per_chip = cpus_per_chip
        self.host_memory_bytes = int(host_memory_gb * 1024**3)
        self.object_store_bytes = object_store_mb * 1024**2
        self.name_prefix = name_prefix
        self.cores: SliceCores = _checked_cores(cores, self.autoscale is not None)
        self.include_dashboard = include_dashboard
        self._connect_on_enter = connect
        # Validate the whole plan before starting anything.
        self.slices: list[EmulatedSlice] = self._plan("127.0.0.1")
        self._cluster: Any = None
        self._config_dir: tempfile.TemporaryDirectory[str] | None = None
        self._extra_host_env: dict[str, str] = {}  # set at start (torch_tpu probe result)

    def _plan(self, ip: str) -> list[EmulatedSlice]:
        if self.autoscale is not None and not self.requests:
            check_positive_int("cpus_per_chip", self.cpus_per_chip)
            return []  # an autoscaling cluster may start with no slice at all
        slices = plan_slices(self.requests, ip, self.name_prefix, self.cpus_per_chip, self.host_memory_bytes)
        if self.cores == "per_slice":
            for sl, cores in zip(slices, split_cores(len(slices), os.sched_getaffinity(0)), strict=True):
                sl.cores = cores
        return slices

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._cluster is not None

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("emulated cluster is not running: call start() or use it as a context manager")
        return self._cluster.address

    def start(self) -> EmulatedCluster:
        if self._cluster is not None:
            return self
        _refuse_on_real_tpu()
        import ray
        from ray.cluster_utils import Cluster

        logger.info("starting emulated TPU cluster: %s", self.describe())
        self._extra_host_env = _torch_tpu_env()
        cluster = Cluster(shutdown_at_exit=True)
        self._cluster = cluster
        try:
            head_env, head_args = self._autoscale_head()
            with _host_environ(head_env):
                _add_node_with_retry(
                    cluster,
                    num_cpus=self.head_cpus,
                    include_dashboard=self.include_dashboard,
                    object_store_memory=self.object_store_bytes,
                    labels={ROLE_LABEL: "head"},
                    _system_config=dict(_GCS_SYSTEM_CONFIG),
                    **head_args,
                )
            # Hostnames: every emulated host lives on this machine, so they all resolve to its IP.
            self.slices = self._plan(ray.util.get_node_ip_address())
            for sl in self.slices:
                sl.node_ids = [self._add_host(host).node_id for host in sl.hosts]
            cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise
        logger.info("emulated TPU cluster up at %s (%d emulated hosts)", self.address, self.num_hosts)
        return self

    def _autoscale_head(self) -> tuple[dict[str, str], dict[str, Any]]:
        """The head's start env and arguments; for an autoscaling cluster, Ray's autoscaler config."""
        if self.autoscale is None:
            return {}, {"env_vars": _vllm_env()}
        self._config_dir = tempfile.TemporaryDirectory(prefix="tpuray-autoscale-")
        provider = {
            "host_env": {**self._extra_host_env, **_vllm_env()},
            "cpus_per_chip": self.cpus_per_chip,
            "host_memory_bytes": self.host_memory_bytes,
            "object_store_bytes": self.object_store_bytes,
            "name_prefix": f"{self.name_prefix}-auto",
        }
        env, args = autoscaling_head(self.autoscale, self.head_cpus, provider, self._config_dir.name)
        return env, {**args, "env_vars": {**_vllm_env(), **args["env_vars"]}}

    def _add_host(self, host: HostSpec) -> Any:
        cores = next(sl.cores for sl in self.slices if sl.name == host.slice_name)
        return start_host(
            self._cluster, host, {**self._extra_host_env, **_vllm_env()}, self.object_store_bytes, cores
        )

    def add_slices(self, request: SliceRequest) -> list[EmulatedSlice]:
        """Start `request.count` more slices by hand on the running cluster (their names continue the
        numbering of their pod type); returns them once every host has joined."""
        import ray

        if self._cluster is None:
            raise RuntimeError("emulated cluster is not running: call start() first")
        if self.cores == "per_slice":
            raise ConfigError(
                "add_slices on a cluster with cores='per_slice': its cores were split among the slices it "
                "started with; start every slice at once (or use cores='shared')"
            )
        planned = plan_slices(
            [*self.requests, request],
            ray.util.get_node_ip_address(),
            self.name_prefix,
            self.cpus_per_chip,
            self.host_memory_bytes,
        )
        added = planned[-request.count :]  # the plan follows the requests: the new ones come last
        self.requests.append(request)
        for sl in added:
            self.slices.append(sl)
            sl.node_ids = [self._add_host(host).node_id for host in sl.hosts]
        self._cluster.wait_for_nodes()
        return added

    def remove_slice(self, name: str) -> None:
        """Stop every host of a slice started by hand (gracefully, as a released node) and forget it: a
        restart no longer starts it. Slices of a pod type are numbered in order (`plan_slices`), so only
        the last of its pod type may go."""
        i = next((i for i, s in enumerate(self.slices) if s.name == name), None)
        if i is None or self._cluster is None:
            raise ConfigError(f"no emulated slice {name!r} started by hand in {self!r}")
        sl = self.slices[i]
        later = [s.name for s in self.slices[i + 1 :] if s.topology.pod_type == sl.topology.pod_type]
        if later:
            raise ConfigError(
                f"cannot remove {name!r} before {later[-1]!r}: slices of a pod type are numbered in order, "
                "so only the last of its pod type may go"
            )
        for node in [n for n in self._cluster.list_all_nodes() if n.node_id in sl.node_ids]:
            self._cluster.remove_node(node, allow_graceful=True)
        del self.slices[i]
        self.requests = _without(self.requests, i)

    def kill_host(self, node_id: str, timeout_s: float = 120.0) -> tuple[str, int]:
        """Hard-kill one emulated TPU host (its raylet and workers), as a host failure would.

        Returns once Ray reports the node dead, with the (slice name, worker id) token `restore_host` takes.
        """
        auto = self._autoscaled_host(node_id)
        if auto is not None:  # started by Ray's autoscaler (in its monitor process): kill its raylet
            name, worker_id, pid = auto
            logger.info("killing emulated TPU host %s worker %d (node %s)", name, worker_id, node_id)
            _kill_pids([pid])
        else:
            sl = self._slice_of(node_id)
            name, worker_id = sl.name, sl.node_ids.index(node_id)
            node = next(n for n in self._cluster.list_all_nodes() if n.node_id == node_id)
            logger.info("killing emulated TPU host %s worker %d (node %s)", name, worker_id, node_id)
            self._cluster.remove_node(node, allow_graceful=False)
        # The GCS notices a dead raylet by missed health checks; wait so callers see a consistent cluster.
        deadline = time.monotonic() + timeout_s
        while self._node_alive(node_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"GCS still reports killed node {node_id} alive after {timeout_s}s")
            time.sleep(0.2)
        return name, worker_id

    def _autoscaled_host(self, node_id: str) -> tuple[str, int, int] | None:
        """(slice name, worker id, raylet pid) of a running host started by Ray's autoscaler, else None."""
        for name, s in self.autoscaled_slices().items():
            if node_id in s["raylet_pids"]:
                return name, s["node_ids"].index(node_id), s["raylet_pids"][node_id]
        return None

    def _check_preemptible(self, node_ids: list[str], restore_after_s: float | None) -> None:
        if self._autoscaled_host(node_ids[0]) is None:
            for node_id in node_ids:
                self._slice_of(node_id)
        elif restore_after_s is not None:
            raise ConfigError(
                f"restore_after_s={restore_after_s!r}: a host started by Ray's autoscaler is not restored; "
                "its slice goes down whole and the autoscaler starts a new one for pending work (use None)"
            )

    def _slice_of(self, node_id: str) -> EmulatedSlice:
        for sl in self.slices:
            if node_id in sl.node_ids:
                return sl
        raise ConfigError(f"node {node_id!r} is not an emulated TPU host (running) of {self!r}")

    def _node_alive(self, node_id: str) -> bool:
        for node in self._cluster.global_state.node_table():
            if node["NodeID"] == node_id:
                return bool(node["Alive"])
        return False

    def restore_host(self, token: tuple[str, int]) -> str:
        """Start a replacement for a killed host: same slice name, worker id, resources, labels, env."""
        name, worker_id = token
        sl = next((s for s in self.slices if s.name == name), None)
        if sl is None or not 0 <= worker_id < len(sl.hosts):
            raise ConfigError(f"no emulated host {token!r} in {self!r}")
        node = self._add_host(sl.hosts[worker_id])
        sl.node_ids[worker_id] = node.node_id
        self._cluster.wait_for_nodes()
        logger.info("restored emulated TPU host %s worker %d (node %s)", name, worker_id, node.node_id)
        return node.node_id

    def preempt_host(self, node_id: str, notice_s: float = 30.0, restore_after_s: float | None = None) -> Any:
        """Emulated spot preemption of one host: drain it now through Ray's drain API (reason PREEMPTION,
        deadline in `notice_s`), kill it at the deadline, and bring a replacement back `restore_after_s`
        later (None: never; call `.restore()` on the returned `Preemption`)."""
        from tpuray.emulator.preemption import Preemption

        self._check_preemptible([node_id], restore_after_s)
        return Preemption(self, [node_id], notice_s, restore_after_s)

    def preempt_slice(self, name: str, notice_s: float = 30.0, restore_after_s: float | None = None) -> Any:
        """Emulated preemption of a whole slice (every host at once, as GKE reclaims a TPU slice)."""
        from tpuray.emulator.preemption import Preemption

        ids = {s.name: list(s.node_ids) for s in self.slices}
        ids.update({n: list(s["raylet_pids"]) for n, s in self.autoscaled_slices().items()})
        if not ids.get(name):
            raise ConfigError(f"no emulated slice {name!r} in this cluster; slices: {sorted(ids)}")
        self._check_preemptible(ids[name], restore_after_s)
        return Preemption(self, ids[name], notice_s, restore_after_s, f"emulated preemption of {name}")

    def connect(self, namespace: str | None = None, **init_kwargs: Any) -> Any:
        """ray.init() this process to the emulated cluster (the driver lives on the CPU head)."""
        import ray

        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if current == self.address:
                return None
            raise RuntimeError(
                f"this process is already connected to another Ray cluster ({current}); "
                f"call ray.shutdown() before connecting to the emulated cluster at {self.address}"
            )
        info = ray.init(address=self.address, namespace=namespace, **init_kwargs)
        return info

    def shutdown(self) -> None:
        """Disconnect this process (if connected here) and stop every node. Idempotent."""
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            return
        import ray

        if ray.is_initialized():
            try:
                same = ray.get_runtime_context().gcs_address == cluster.address
            except Exception:
                same = True
            if same:
                ray.shutdown()
        nodes = cluster.list_all_nodes()
        autoscaled = self._autoscaled_pids(cluster.address)
        try:
            cluster.shutdown()
        finally:
            alive = [n for n in nodes if n.any_processes_alive()]
            for node in alive:
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            # The autoscaler's hosts die with Ray's monitor (they share its fate); make sure of it.
            _kill_pids(autoscaled)
            for sl in self.slices:
                sl.node_ids = []
            if self._config_dir is not None:
                self._config_dir.cleanup()
                self._config_dir = None
        logger.info("emulated TPU cluster stopped")

    def __enter__(self) -> EmulatedCluster:
        self.start()
        if self._connect_on_enter:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- introspection -------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Process ids of every Ray system process of every node (raylets, GCS, agents)."""
        if self._cluster is None:
            return []
        return [
            info.process.pid
            for node in self._cluster.list_all_nodes()
            for infos in node.all_processes.values()
            for info in infos
        ] + self._autoscaled_pids(self.address)

    def _autoscaled_pids(self, address: str) -> list[int]:
        if self.autoscale is None:
            return []
        try:
            return [p for s in published_slices(address).values() for p in s["pids"]]
        except Exception as e:  # a GCS already gone: nothing more to learn
            logger.warning("could not read the autoscaled slices: %s", e)
            return []

    def autoscaled_slices(self) -> dict[str, AutoscaledSlice]:
        """The slices Ray's autoscaler runs now ({name: {node_type, state, node_ids, ...}}; state is
        starting, up or stopping); {} for a cluster without autoscale."""
        if self.autoscale is None or self._cluster is None:
            return {}
        return published_slices(self.address)

    @property
    def dashboard_url(self) -> str | None:
        """Ray's dashboard (http://host:port) when the head runs one, else None."""
        if self._cluster is None or not self.include_dashboard:
            return None
        url = self._cluster.head_node.address_info.get("webui_url")
        return f"http://{url}" if url else None

    @property
    def num_hosts(self) -> int:
        return sum(len(sl.hosts) for sl in self.slices)

    def describe(self) -> str:
        if self.autoscale is not None:
            fixed = f"; fixed: {len(self.slices)} slice(s)" if self.requests else ""
            return (
                f"emulated TPU, autoscaling (Ray's autoscaler; idle_timeout_s={self.autoscale.idle_timeout_s:g}): "
                f"{self.autoscale.describe()}{fixed}"
            )
        parts = []
        for r in self.requests:
            t = r.slice_topology
            parts.append(f"{r.count} x {t.generation.accelerator_type} {t.topology} ({t.num_hosts} host(s))")
        own = "; each slice on cores of its own" if self.cores == "per_slice" else ""
        return "emulated TPU: " + ", ".join(parts) + own

    def __repr__(self) -> str:
        state = f"address={self._cluster.address!r}" if self._cluster else "stopped"
        names = [sl.name for sl in self.slices]
        return f"EmulatedCluster({self.describe()}; slices={names}; {state})"


def _checked_cores(cores: str, autoscale: bool) -> SliceCores:
    """`cores` where valid (EmulatedCluster's docstring), else ConfigError naming it and the valid set."""
    check_choice("cores", cores, SLICE_CORES)
    if cores == "per_slice" and autoscale:
        raise ConfigError(
            "cores='per_slice' pins slices started by hand; Ray's autoscaler starts its slices itself "
            "(use cores='shared' with autoscale=True)"
        )
    if cores == "per_slice" and not hasattr(os, "sched_setaffinity"):
        raise ConfigError("cores='per_slice' needs Linux's sched_setaffinity; use cores='shared' here")
    return cast(SliceCores, cores)


def _without(requests: list[SliceRequest], index: int) -> list[SliceRequest]:
    """`requests` less the slice planned `index`-th (plan_slices' order)."""
    out = []
    for req in requests:
        if 0 <= index < req.count:
            if req.count > 1:
                out.append(dataclasses.replace(req, count=req.count - 1))
        else:
            out.append(req)
        index -= req.count
    return out
