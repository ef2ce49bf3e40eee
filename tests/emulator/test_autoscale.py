"""Slices on demand: Ray's autoscaler starts and stops whole emulated slices (tpuray.emulator.autoscale).

One autoscaling cluster for the module (started after the default cluster is shut down), small slice
shapes: a v4 2x2x2 (two hosts) and a v6e 2x2 (one host), idle timeout 6 s, Ray's monitor every second.
Ray's autoscaler counts a new host idle from its raylet's start until its first placement group is
reported: on two loaded cores that took over 2 s, and a 2 s timeout removed a host a reservation had
just been placed on. Each test's placement groups are removed after it, passed or failed, so that one
failure does not leave the next test's slices held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.tpu import SlicePlacementGroup as RaySlicePlacementGroup

from _util import free_port, live_placement_groups
from tpuray.constants import POD_TYPE_LABEL, SLICE_NAME_LABEL, WORKER_ID_LABEL
from tpuray.emulator import EmulatedCluster
from tpuray.emulator.churn import audit, run_churn
from tpuray.emulator.detached import _alive
from tpuray.slices.placement import SlicePlacementGroup
from tpuray.validation import ConfigError

V4 = ("TPU-V4", "2x2x2")  # 2 hosts x 4 chips: the smallest multi-host slice
V6E = ("TPU-V6E", "2x2")  # 1 host x 4 chips
V5E = ("TPU-V5E", "2x2")  # 1 host x 4 chips


@pytest.fixture(scope="module")
def autoscaling(cluster_manager) -> Iterator[EmulatedCluster]:  # type: ignore[no-untyped-def]
    cluster_manager.shutdown()
    cluster = EmulatedCluster(
        [], head_cpus=2, cpus_per_chip=1, autoscale=True, max_slices={V4: 1, V6E: 2, V5E: 1}, idle_timeout_s=6
    )
    with cluster:
        cluster.connect()
        yield cluster
        pids = cluster.pids()
    assert not [p for p in pids if _alive(p)], "processes left after shutdown"


@pytest.fixture(autouse=True)
def _placement_groups_removed() -> Iterator[None]:
    """After each test, passed or failed, no placement group of its is left holding slices."""
    yield
    for pg_id in live_placement_groups():
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))


def wait_for(what, timeout_s: float = 120.0):  # type: ignore[no-untyped-def]
    """Poll `what()` until truthy (returns it); the timeout only bounds a failing test."""
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)
    return value


def check_whole(cluster: EmulatedCluster) -> dict[str, list[str]]:
    """The invariant (tpuray.emulator.churn.audit): no partial slice, no leaked TPU node. Returns the
    whole slices ({name: alive node ids})."""
    seen = audit(cluster)
    assert seen.ok, seen
    return seen.whole


def test_bad_autoscale_settings_raise_before_starting() -> None:
    with pytest.raises(
        ConfigError, match=r"autoscale=True needs max_slices=\{\(accelerator type, topology\): N"
    ):
        EmulatedCluster([], autoscale=True)
    with pytest.raises(ConfigError, match="only valid with autoscale=True"):
        EmulatedCluster([], idle_timeout_s=5)
    with pytest.raises(ValueError, match="3x3"):
        EmulatedCluster([], autoscale=True, max_slices={("TPU-V6E", "3x3"): 1})
    with pytest.raises(ConfigError, match="same slice shape twice"):
        EmulatedCluster([], autoscale=True, max_slices={("v6e", "2x2"): 1, ("TPU-V6E", "2x2"): 1})
    with pytest.raises(ConfigError, match="idle_timeout_s=-1 is invalid"):
        EmulatedCluster([], autoscale=True, max_slices={V6E: 1}, idle_timeout_s=-1)


def test_pending_reservations_bring_whole_slices_and_idle_slices_go(autoscaling: EmulatedCluster) -> None:
    assert autoscaling.autoscaled_slices() == {} and check_whole(autoscaling) == {}
    # Shapes no node type brings fail at once, naming the shape and the node types; nothing is reserved.
    with pytest.raises(ConfigError, match=r"1 x TPU-V6E 4x4 \(pod type v6e-16\) can never be reserved") as e:
        SlicePlacementGroup("4x4", "v6e", timeout_s=180)
    assert "tpu-v4-16 (TPU-V4 2x2x2, at most 1), tpu-v6e-4 (TPU-V6E 2x2, at most 2)" in str(e.value)
    assert "v5litepod" in str(e.value)
    with pytest.raises(ConfigError, match=r"3 x TPU-V6E 2x2 \(pod type v6e-4\) can never"):
        SlicePlacementGroup("2x2", "v6e", num_slices=3, timeout_s=180)
    assert not live_placement_groups()
    # Ray's own SlicePlacementGroup asks for a multi-host slice the same way (its head bundle first).
    ray_spg = RaySlicePlacementGroup("2x2x2", "v4")
    assert ray.get(ray_spg.placement_group.ready(), timeout=180)
    assert [s["node_type"] for s in autoscaling.autoscaled_slices().values()] == ["tpu-v4-16"]
    check_whole(autoscaling)
    ray_spg.shutdown()
    spg = SlicePlacementGroup("2x2x2", "v4", timeout_s=180)  # the idle slice, or (idled out) a new one
    (name,) = spg._slice_names
    alive = check_whole(autoscaling)
    assert list(alive) == [name] and len(alive[name]) == 2
    assert autoscaling.autoscaled_slices()[name]["node_type"] == "tpu-v4-16"
    # Two pending v6e reservations at once (one placement group each): two slices, one per reservation.
    two = SlicePlacementGroup("2x2", "v6e", num_slices=2, timeout_s=180)
    assert len(set(two._slice_names)) == 2
    assert sorted(s["node_type"] for s in autoscaling.autoscaled_slices().values()) == [
        "tpu-v4-16",
        "tpu-v6e-4",
        "tpu-v6e-4",
    ]
    check_whole(autoscaling)
    # A third v6e reservation is over max_slices: it waits, and `tpuray status` shows it as demand.
    extra = placement_group([{"TPU-v6e-4-head": 1}])
    status = subprocess.run(
        [sys.executable, "-m", "tpuray.cli", "status", "--address", autoscaling.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "pending slice demand: 1 x v6e-4" in status.stdout
    assert f"  {name}: tpu-v4-16, in use" in status.stdout
    assert "TPU-V6E 2x2 (tpu-v6e-4) <= 2" in status.stdout
    remove_placement_group(extra)
    two.shutdown()
    spg.shutdown()
    wait_for(lambda: not autoscaling.autoscaled_slices())  # idle_timeout_s later: all gone, whole
    assert check_whole(autoscaling) == {}


def autoscaler_round_after(ts: float) -> bool:
    """Whether Ray's monitor has finished an autoscaler round that started after UNIX time `ts`."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    return bool(raw) and json.loads(raw)["time"] > ts


@ray.remote(num_cpus=1)
class OnHost:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_busy_host_keeps_its_slice_and_a_lost_host_takes_its_slice_down(
    autoscaling: EmulatedCluster,
) -> None:
    spg = SlicePlacementGroup("2x2x2", "v4", timeout_s=180)
    (name,) = spg._slice_names
    node_ids = autoscaling.autoscaled_slices()[name]["node_ids"]
    # Worker 1 busy (a CPU of its host taken while the reservation still holds the chips, so the slice is
    # never idle in between), worker 0 idle: the slice outlives idle_timeout_s (a few rounds past it).
    busy = OnHost.options(label_selector={SLICE_NAME_LABEL: name, WORKER_ID_LABEL: "1"}).remote()
    assert ray.get(busy.node.remote(), timeout=60) == node_ids[1]
    spg.shutdown()
    past_idle = time.time() + 2 * autoscaling.autoscale.idle_timeout_s  # type: ignore[union-attr]
    wait_for(lambda: autoscaler_round_after(past_idle))
    assert list(check_whole(autoscaling)) == [name]
    ray.kill(busy)
    wait_for(lambda: not autoscaling.autoscaled_slices())  # then it goes, both hosts at once
    assert check_whole(autoscaling) == {}

    # A reservation holds a new slice; one of its hosts is preempted: the whole slice goes, and Ray's
    # autoscaler brings a replacement up for the reservation's head, pending again.
    spg = SlicePlacementGroup("2x2x2", "v4", timeout_s=180)
    (lost,) = spg._slice_names
    lost_ids = autoscaling.autoscaled_slices()[lost]["node_ids"]
    with pytest.raises(ConfigError, match="not restored"):
        autoscaling.preempt_host(lost_ids[1], notice_s=0, restore_after_s=0)
    autoscaling.preempt_host(lost_ids[1], notice_s=0).wait_killed(timeout_s=60)
    wait_for(lambda: lost not in autoscaling.autoscaled_slices())  # the provider's next round
    wait_for(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] in lost_ids))
    (new,) = wait_for(lambda: list(check_whole(autoscaling)))
    head_pg = spg._head_pgs[0]
    new_ids = autoscaling.autoscaled_slices()[new]["node_ids"]
    wait_for(lambda: placement_group_table(head_pg)["bundles_to_node_id"].get(0) == new_ids[0])
    spg.shutdown()
    wait_for(lambda: not autoscaling.autoscaled_slices())
    assert check_whole(autoscaling) == {}


def test_seeded_random_schedule_keeps_slices_whole(autoscaling: EmulatedCluster) -> None:
    """Reservations, releases and preemptions over 3 slice shapes in a seeded random order: after every
    event, no partial slice and no leaked node (bench_autoscale.py runs 20 cycles; CI runs 3)."""
    seen: list[str] = []
    report = run_churn(autoscaling, [V4, V6E, V5E], cycles=3, seed=24, on_event=lambda e, _: seen.append(e))
    assert report.partial == 0 and report.leaked == 0, report
    assert report.audits == len(seen) >= 7 and seen[-1] == "all idle slices gone"
    assert autoscaling.autoscaled_slices() == {} and check_whole(autoscaling) == {}


def slices_ever() -> dict[str, str]:
    """Every emulated slice this cluster has had, alive or gone ({slice name: pod type}): Ray keeps the
    labels of dead nodes."""
    return {
        labels[SLICE_NAME_LABEL]: labels[POD_TYPE_LABEL]
        for labels in (n.get("Labels") or {} for n in ray.nodes())
        if SLICE_NAME_LABEL in labels
    }


def _ray_train_probe(config: dict) -> None:
    import torch.distributed as dist

    with open(config["out"], "w") as f:
        json.dump({"slice": os.environ.get("TPU_NAME"), "world": dist.get_world_size()}, f)


@pytest.mark.full(
    "CI: pending reservations bring whole slices and idle ones go (test_pending_reservations_...), the seeded random schedule"
)
def test_ray_train_and_a_serving_replica_each_bring_one_slice(autoscaling: EmulatedCluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ray's single-host SlicePlacementGroup, Ray Train's TorchTrainer(use_tpu=True) and a serving replica on
    a slice, each on a cluster with no TPU host: each brings up slices of its shape only and runs on one;
    shapes no node type brings fail before anything is reserved or deployed."""
    from ray import serve
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tpuray.models import build_tiny_causal_lm
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app
    from tpuray.train import RunConfig as TpurayRun
    from tpuray.train import ScalingConfig as TpurayScaling
    from tpuray.train.torch import TorchTrainer as TpurayTrainer

    def new_slices(before: dict[str, str]) -> tuple[set[str], str]:
        """(the slices started since `before`, their one pod type). Ray's v1 autoscaler can start a second
        slice of the same type for one request: see docs/autoscaling.md, "A request counted twice"."""
        new = {name: pod for name, pod in slices_ever().items() if name not in before}
        assert len(set(new.values())) == 1, new
        return set(new), next(iter(new.values()))

    wait_for(lambda: not autoscaling.autoscaled_slices())
    # Ray's own single-host reservation: one bundle {"TPU": 4, "CPU": 1}, no head, no label selector. It names
    # no accelerator type, so any single-host 4-chip node type fits it (docs/autoscaling.md).
    before = slices_ever()
    ray_spg = RaySlicePlacementGroup("2x2", "v6e")
    assert ray.get(ray_spg.placement_group.ready(), timeout=180)
    assert new_slices(before)[1] in {"v6e-4", "v5litepod-4"}
    ray_spg.shutdown()

    # Ray Train's TorchTrainer: its bundle {"TPU": 4, "CPU": 1, "accelerator_type:TPU-V6E": 0.001} brings a v6e.
    before = slices_ever()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        _ray_train_probe,
        train_loop_config={"out": str(tmp_path / "rank0.json")},
        scaling_config=ScalingConfig(num_workers=1, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E"),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="autoscaled"),
    )
    assert trainer.fit().error is None
    ran = json.loads((tmp_path / "rank0.json").read_text())
    started, pod_type = new_slices(before)
    assert pod_type == "v6e-4" and ran["world"] == 1 and ran["slice"] in started
    # tpuray's TorchTrainer reserves through tpuray's SlicePlacementGroup: a shape no node type brings fails
    # at once, naming the shape and the node types.
    no_slice = TpurayTrainer(
        _ray_train_probe,
        scaling_config=TpurayScaling(
            num_workers=4, use_tpu=True, topology="2x2x1", accelerator_type="TPU-V4"
        ),
        run_config=TpurayRun(storage_path=str(tmp_path / "tpuray"), name="no-slice"),
    )
    with pytest.raises(
        ConfigError, match=r"1 x TPU-V4 2x2x1 \(pod type v4-8\) can never be reserved.*tpu-v6e-4"
    ):
        no_slice.fit()

    # A serving replica on a v6e 2x2 slice (the embedded engine: one worker holding the host's 4 chips).
    model = str(build_tiny_causal_lm(tmp_path / "model", max_position_embeddings=256))

    def config(topology: str, hosts: int = 1) -> LLMConfig:
        return LLMConfig(
            model_loading_config={"model_id": "tiny", "model_source": model},
            llm_engine="embedded",
            accelerator_type="TPU-V6E",
            accelerator_config={"kind": "tpu", "topology": topology},
            placement_group_config={"bundle_per_worker": {"TPU": 4}},
            engine_kwargs={"tensor_parallel_size": hosts, "max_model_len": 256},
        )

    with pytest.raises(ConfigError, match=r"1 x TPU-V6E 4x4 \(pod type v6e-16\) can never be reserved") as e:
        build_openai_app(LLMServingArgs(llm_configs=[config("4x4", hosts=4)]))
    assert "tpu-v4-16 (TPU-V4 2x2x2, at most 1)" in str(e.value)
    wait_for(lambda: not autoscaling.autoscaled_slices())
    before = slices_ever()
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        handle = serve.run(build_openai_app(LLMServingArgs(llm_configs=[config("2x2")])), name="auto")
        (worker,) = handle.describe.remote().result()["workers"]
        (name,) = (n["Labels"][SLICE_NAME_LABEL] for n in ray.nodes() if n["NodeID"] == worker["node_id"])
        started, pod_type = new_slices(before)
        assert pod_type == "v6e-4" and name in started and name in autoscaling.autoscaled_slices()
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2
    finally:
        serve.shutdown()
    wait_for(lambda: not live_placement_groups())
    wait_for(lambda: not autoscaling.autoscaled_slices())
