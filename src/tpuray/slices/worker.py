"""The actor side of a worker group: `SliceWorker`, the base of every per-chip actor tpuray starts.

Training (`tpuray.train`) and serving (`tpuray.serve.llm.engine.embedded`) subclass it and add their own methods;
`SliceWorkerGroup` wraps the subclass with `ray.remote`. Placement reporting, the process env, the
process group and its teardown live here once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tpuray.constants import (
    EMULATION_ENV,
    HOST_ENV,
    TPU_NAME_ENV,
    TPU_RESOURCE,
    TPU_WORKER_ID_ENV,
)
from tpuray.isolation import apply_process_env
from tpuray.slices import distributed


@dataclass(frozen=True)
class WorkerPlacement:
    """Where Ray placed one worker actor, as the actor sees it."""

    node_id: str
    node_ip: str
    pid: int
    tpu_chips: tuple[int, ...] = ()  # the chips Ray assigned (TPU_VISIBLE_CHIPS)
    gpu_ids: tuple[str, ...] = ()
    host_env: tuple[tuple[str, str], ...] = ()  # the TPU host env (TPU_NAME, TPU_WORKER_ID, ...)
    emulated: bool = False  # the host is an emulated TPU host

    @property
    def host(self) -> dict[str, str]:
        return dict(self.host_env)

    @property
    def worker_id(self) -> int | None:
        raw = self.host.get(TPU_WORKER_ID_ENV)
        return int(raw) if raw not in (None, "") else None

    @property
    def slice_name(self) -> str | None:
        return self.host.get(TPU_NAME_ENV) or None


class SliceWorker:
    """Actor body shared by training and engine workers (subclass it; do not decorate it)."""

    def placement(self) -> WorkerPlacement:
        import ray

        ctx = ray.get_runtime_context()
        ids = ctx.get_accelerator_ids()
        return WorkerPlacement(
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            tpu_chips=tuple(sorted(int(i) for i in ids.get(TPU_RESOURCE, []))),
            gpu_ids=tuple(str(i) for i in ids.get("GPU", [])),
            host_env=tuple((k, os.environ[k]) for k in HOST_ENV if k in os.environ),
            emulated=os.environ.get(EMULATION_ENV) == "1",
        )

    def ping(self) -> bool:
        return True

    def free_port(self) -> int:
        return distributed.free_port()

    def setup_distributed(self, env: dict[str, str], backend: str | None, timeout_s: float) -> None:
        """Install this rank's process env (dropping Ray's sub-host bounds: `apply_process_env`); with a
        backend, create the default process group."""
        apply_process_env(env)
        if backend is not None:
            distributed.init_process_group(backend, timeout_s)

    def teardown_distributed(self) -> None:
        distributed.destroy_process_group()
