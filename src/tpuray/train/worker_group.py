"""A group of Ray Core actors, one per training worker, gang-reserved with a placement group.

TPU: `tpuray.SlicePlacementGroup` reserves whole slices (one bundle per host, slice-major, by worker id);
`workers_per_host` actors go into each host bundle with `resources={"TPU": k}`. Ranks are ordered by
(slice, host worker id, chip Ray assigned), so LOCAL_RANK == TPU_VISIBLE_CHIPS as TorchTPU requires.
CPU/GPU: a plain placement group with one bundle per worker; ranks grouped by node.

`WorkerGroup.shutdown()` kills every actor and removes the placement group; it is safe to call twice
and on a partially started group.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpuray.train import backend_setup
from tpuray.train.backend_setup import RankInfo
from tpuray.train.checkpoint import Checkpoint
from tpuray.train.config import ScalingConfig
from tpuray.train.session import TrainContext

RESERVE_TIMEOUT_S = float(os.environ.get("TPURAY_TRAIN_RESERVE_TIMEOUT_S", "300"))


@dataclass
class WorkerOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""


@ray.remote(max_concurrency=2)
class TrainWorker:
    """Runs the training function in one process (`run`) while the driver drains reports (`drain`)."""

    def __init__(self) -> None:
        import torch  # noqa: F401  (warm the import while the other workers start)

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        ids = ctx.get_accelerator_ids()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "tpu_ids": [int(i) for i in ids.get("TPU", [])],
            "gpu_ids": list(ids.get("GPU", [])),
            "tpu_worker_id": os.environ.get("TPU_WORKER_ID"),
            "emulated": os.environ.get("TPURAY_EMULATION") == "1",
            "pid": os.getpid(),
        }

    def ping(self) -> bool:
        return True

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(
        self, env: dict[str, str], context: TrainContext, checkpoint, first_index: int, backend, timeout_s
    ):
        import tpuray.train.torch  # noqa: F401  (so `tpuray.train.torch.get_device()` resolves in user code)
        from tpuray.train import session

        os.environ.update(env)
        session._start(context, checkpoint, first_index)
        backend_setup.init_process_group(backend, timeout_s)  # also for 1 worker, as Ray Train does

    def run(self, fn, config) -> WorkerOutcome:
        from tpuray.train import session

        rank = session._require("run").context.world_rank
        try:
            value = fn(config) if config is not None else _call_maybe_without_config(fn)
            return WorkerOutcome(rank, True, value=value)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the driver with its traceback
            return WorkerOutcome(rank, False, error=_picklable(exc), traceback=traceback.format_exc())
        finally:
            try:
                backend_setup.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass

    def drain(self) -> list:
        from tpuray.train import session

        sess = session._current()
        return sess.drain() if sess is not None else []


def _call_maybe_without_config(fn):
    import inspect

    try:
        n_params = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n_params = 1
    return fn() if n_params == 0 else fn({})


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@dataclass
class _Member:
    actor: Any
    info: dict[str, Any]
    rank: RankInfo | None = None
    bundle: int = 0


class WorkerGroup:
    """Reserve, start, rank and set up the workers of one training attempt."""

    def __init__(self, scaling: ScalingConfig) -> None:
        self.scaling = scaling
        self.members: list[_Member] = []  # ordered by world rank once started
        self._pg = None
        self._spg = None
        self.master_addr = ""
        self.master_port = 0
        self.emulated = False

    # ---- reservation -------------------------------------------------------------------------
    def start(self) -> None:
        actors = self._reserve_and_create()
        infos = ray.get([a.info.remote() for a, _ in actors])
        members = [_Member(actor, info, bundle=b) for (actor, b), info in zip(actors, infos, strict=True)]
        self.members = self._assign_ranks(members)
        self.emulated = any(m.info["emulated"] for m in self.members)
        self.master_addr = self.members[0].info["node_ip"]
        self.master_port = ray.get(self.members[0].actor.free_port.remote())

    def _reserve_and_create(self) -> list[tuple[Any, int]]:
        sc = self.scaling
        res = sc.worker_resources()
        num_cpus = res.pop("CPU", 0)
        num_gpus = res.pop("GPU", 0)
        created = []
        if sc.use_tpu:
            from tpuray.slices import SlicePlacementGroup

            topo = sc.slice_topology
            per_host = sc.workers_per_host
            extra = {"CPU": num_cpus * per_host} if num_cpus else None
            self._spg = SlicePlacementGroup(
                topology=topo.topology,
                accelerator_version=topo.generation.name,
                num_slices=sc.num_slices,
                resources_per_bundle=extra,
                timeout_s=RESERVE_TIMEOUT_S,
            )
            pg = self._spg.placement_group
            bundles = [(b, per_host) for b in range(self._spg.num_bundles)]
        else:
            bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **res}
            bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
            self._pg = placement_group(
                [dict(bundle) for _ in range(sc.num_workers)], strategy=sc.placement_strategy
            )
            try:
                ray.get(self._pg.ready(), timeout=RESERVE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError as exc:
                raise TimeoutError(
                    f"could not reserve {sc.num_workers} workers x {bundle} ({sc.placement_strategy}) within "
                    f"{RESERVE_TIMEOUT_S:.0f}s; cluster resources: {ray.cluster_resources()}"
                ) from exc
            pg = self._pg
            bundles = [(b, 1) for b in range(sc.num_workers)]
        for b, count in bundles:
            for _ in range(count):
                actor = TrainWorker.options(
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    resources=res or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                ).remote()
                created.append((actor, b))
                self.members.append(_Member(actor, {}, bundle=b))  # tracked for shutdown right away
        return created

    def _assign_ranks(self, members: list[_Member]) -> list[_Member]:
        sc = self.scaling
        world = len(members)
        if sc.use_tpu:
            per_host = sc.workers_per_host
            hosts_per_slice = sc.slice_topology.num_hosts
            per_slice = per_host * hosts_per_slice
            members.sort(key=lambda m: (m.bundle, min(m.info["tpu_ids"] or [0])))
            for i, m in enumerate(members):
                host = m.bundle
                local = i - host * per_host
                chips = m.info["tpu_ids"]
                if per_host > 1 and chips and sc.tpus_per_worker == 1 and local != chips[0]:
                    raise RuntimeError(
                        f"worker on host {host} got chip {chips} but local rank {local}: Ray's TPU assignment "
                        "does not match the host's chips"
                    )
                m.rank = RankInfo(i, world, local, per_host, host, host // hosts_per_slice, i % per_slice)
        else:
            node_order: list[str] = []
            for m in members:
                if m.info["node_id"] not in node_order:
                    node_order.append(m.info["node_id"])
            members.sort(key=lambda m: (node_order.index(m.info["node_id"]), m.bundle))
            local_counts = {n: sum(m.info["node_id"] == n for m in members) for n in node_order}
            seen: dict[str, int] = {}
            for i, m in enumerate(members):
                node = m.info["node_id"]
                local = seen.get(node, 0)
                seen[node] = local + 1
                m.rank = RankInfo(i, world, local, local_counts[node], node_order.index(node))
        return members

    # ---- setup / run -------------------------------------------------------------------------
    def env_for(self, m: _Member) -> dict[str, str]:
        env = backend_setup.torchrun_env(m.rank, self.master_addr, self.master_port)
        sc = self.scaling
        if sc.use_tpu:
            topo = sc.slice_topology
            per_slice = sc.workers_per_host * topo.num_hosts
            start = m.rank.slice_index * per_slice
            slice_members = self.members[start : start + per_slice]
            hostnames = [x.info["node_ip"] for x in slice_members[:: sc.workers_per_host]]
            env.update(
                backend_setup.tpu_env(
                    m.rank, topo, hostnames, int(sc.tpus_per_worker), sc.num_slices, self.master_addr
                )
            )
        return env

    def setup(
        self, make_context, checkpoint: Checkpoint | None, first_index: int, backend: str, timeout_s: float
    ):
        refs = [
            m.actor.setup.remote(
                self.env_for(m), make_context(m.rank), checkpoint, first_index, backend, timeout_s
            )
            for m in self.members
        ]
        return refs

    def run(self, fn_ref, config) -> list:
        return [m.actor.run.remote(fn_ref, config) for m in self.members]

    def drain(self) -> list[list]:
        return ray.get([m.actor.drain.remote() for m in self.members])

    # ---- teardown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        for m in self.members:
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.members = []
        if self._spg is not None:
            try:
                self._spg.shutdown()
            finally:
                self._spg = None
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
