"""Starting emulated TPU hosts: each one a real raylet whose resources, labels and env are those of a TPU
host, with its host env in place while Ray detects them (used by EmulatedCluster for hand-started slices
and by EmulatedSliceProvider for the slices Ray's autoscaler starts)."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tpuray.constants import EMULATED_CORES_LABEL, VLLM_PLATFORM_ENV
from tpuray.emulator.spec import HostSpec
from tpuray.validation import ConfigError

logger = logging.getLogger(__name__)

_ENV_LOCK = threading.Lock()

# Ray settings that cut what an IDLE emulated cluster burns (Ray's dashboard agents report node stats every
# 5 s and metrics every 10 s; each raylet prestarts workers for the first driver). For a machine that runs
# emulated clusters for long with nothing reading Ray's node stats or metrics (the test suite); set them in
# os.environ before a cluster starts: every Ray process inherits them. benchmarks/bench_idle_cluster.py
# measures them against Ray's defaults.
QUIET_RAY_ENV: dict[str, str] = {
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "METRICS_RECORD_INTERVAL_S": "60",
    "RAY_metrics_report_interval_ms": "60000",
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}


@contextmanager
def _host_environ(env: dict[str, str]) -> Iterator[None]:
    """Ray resolves a node's TPU resources/labels from os.environ of the process starting it."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextmanager
def _on_cores(cores: tuple[int, ...]) -> Iterator[None]:
    """Processes this thread starts inside the block run on `cores` alone (() changes nothing): Linux hands
    a thread's CPU affinity to the processes it starts, and a raylet hands its own to the workers it
    starts. Other threads keep theirs."""
    if not cores:
        yield
        return
    saved = os.sched_getaffinity(0)  # 0: this thread
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _torch_tpu_env() -> dict[str, str]:
    """The torch_tpu part of every emulated host's env. Where torch_tpu is installed: probe it once here
    (seconds) and hand the answer to every host, so that their workers do not each probe again; warn when
    it blocks emulation. Where it is not: tpuray's emulated torch_tpu on the hosts' PYTHONPATH."""
    from tpuray.runtime.detect import (
        PROBE_ENV,
        emulation_blocked_reason,
        torch_tpu_installed,
        torch_tpu_usable,
    )

    if not torch_tpu_installed():
        # Ray's own TPU code (ray.train's use_tpu path) imports torch_tpu: emulated hosts get tpuray's
        # emulated torch_tpu on their import path (never where a real one is installed).
        from tpuray.runtime.detect import SHIM_DIR

        path = os.pathsep.join(p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path}
    env = {PROBE_ENV: "1" if torch_tpu_usable() else "0"}
    blocked = emulation_blocked_reason()
    if blocked:
        logger.warning("emulated TPU hosts will not have an emulated tpu device: %s", blocked)
    return env


def _refuse_on_real_tpu() -> None:
    """An emulated slice on a machine with usable TPU chips would hand its workers the real chips under
    emulated labels: refuse, before anything starts."""
    from tpuray.runtime.detect import torch_tpu_usable

    if torch_tpu_usable():
        raise ConfigError(
            "this machine has usable TPU chips (torch_tpu works here): tpuray emulates TPU slices only "
            "where there are none. Run on the chips directly (`ray start` on the TPU VM, see docs/real-tpu.md)"
        )


def _vllm_env() -> dict[str, str]:
    """vLLM on an emulated cluster (every node, the CPU head included, where serving replicas and vLLM's
    engine core run): vLLM's platform is tpuray's EmulatedTpuPlatform (its CPU backend, scheduled one
    worker per emulated chip), and each vLLM CPU worker takes a 1 GiB KV cache unless set otherwise,
    like the emulated hosts' 4 GiB of memory. Ray Serve LLM's TPU path then runs unchanged."""
    from tpuray.serve.llm.engine.vllm.plugin import EMULATED_TPU

    return {
        VLLM_PLATFORM_ENV: EMULATED_TPU,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }


# The GCS health-checks every raylet each `health_check_period_ms` and declares it dead after
# `health_check_failure_threshold` failures in a row. Ray's default period (3 s) makes a killed emulated host
# (kill_host, a preemption's kill) take ~15 s to be seen dead; every emulated host is a local process, so a
# refused check is certain and a short period is enough (~2.5 s). A live but busy raylet still needs 5
# checks timing out (Ray's default timeout and threshold) before it is declared dead.
_GCS_SYSTEM_CONFIG = {"health_check_period_ms": 500}


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _add_node_with_retry(cluster: Any, attempts: int = 3, **node_args: Any) -> Any:
    """cluster.add_node, retried when Ray's fixed 30 s node-registration wait runs out (a loaded machine).

    A node that timed out is stopped before the retry, so no half-started raylet is left behind.
    Call with _ENV_LOCK held (it swaps ray's Node class to keep a handle on the node being started).
    """
    import ray._private.node as ray_node

    base = ray_node.Node
    started: list[Any] = []

    class _TrackedNode(base):  # type: ignore[misc, valid-type]
        def _register_shutdown_hooks(self) -> None:
            # Python takes signal handlers in the main thread only: a node started from another thread
            # (an emulated preemption's replacement) gets the atexit clean-up alone.
            if threading.current_thread() is threading.main_thread():
                super()._register_shutdown_hooks()
            else:
                atexit.register(lambda: self.kill_all_processes(check_alive=False, allow_graceful=True))

        def start_head_processes(self) -> None:
            started.append(self)
            super().start_head_processes()

        def start_ray_processes(self) -> None:
            if self not in started:
                started.append(self)
            super().start_ray_processes()

    for attempt in range(1, attempts + 1):
        started.clear()
        ray_node.Node = _TrackedNode
        try:
            return cluster.add_node(**node_args)
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts:
                for node in started:
                    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
                raise
            logger.warning("emulated node start timed out (attempt %d/%d); retrying", attempt, attempts)
            for node in started:
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        finally:
            ray_node.Node = base
    raise AssertionError("unreachable")


def start_host(
    cluster: Any,
    host: HostSpec,
    extra_env: dict[str, str],
    object_store_bytes: int,
    cores: tuple[int, ...] = (),
) -> Any:
    """Start one emulated TPU host as a raylet of `cluster` (anything with Cluster.add_node's signature),
    with the host's resources, labels and env (plus `extra_env`) in place while Ray detects them; its
    processes on `cores` alone where given (its slice's, cores="per_slice")."""
    env = {**host.env, **extra_env}
    labels = {**host.labels, **({EMULATED_CORES_LABEL: ",".join(map(str, cores))} if cores else {})}
    with _host_environ(env), _on_cores(cores):
        return _add_node_with_retry(
            cluster,
            num_cpus=host.num_cpus,
            memory=host.memory,
            object_store_memory=object_store_bytes,
            resources=dict(host.resources),
            labels=labels,
            env_vars=env,
            node_name=host.node_name,
        )
