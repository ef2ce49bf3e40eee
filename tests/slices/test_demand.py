"""What Ray's v2 autoscaler on KubeRay makes of a pending tpuray slice reservation (tpuray.slices.demand).

No KubeRay runs here, so the chain is cut where Ray's own code hands over: a real `SlicePlacementGroup` for
a v6e 4x4 waits on the emulated cluster (which has no such slice), the cluster's GCS reports its pending
placement group to autoscalers (`get_cluster_resource_state`, what Ray's v2 autoscaler reads each round),
Ray's v2 scheduler places that demand on the node types Ray derives from `tpuray k8s --autoscale`'s
RayCluster, and Ray's v2 KubeRay provider writes the launch into the RayCluster's replicas (an in-memory
Kubernetes API, tests/k8s/test_k8s_kuberay_provider.py)."""

from __future__ import annotations

import time

import pytest

from _util import in_thread, live_placement_groups, new_placement_groups
from k8s.test_k8s_autoscale import _schedule
from k8s.test_k8s_kuberay_provider import _launch, _provider
from tpuray import SlicePlacementGroup
from tpuray.constants import SLICE_DEMAND_ENV
from tpuray.k8s import AutoscaleConfig, K8sConfig
from tpuray.slices import SliceReservationTimeout
from tpuray.slices import demand as demand_module
from tpuray.slices.demand import slice_demand
from tpuray.validation import ConfigError


def _pending_gang(emulated_cluster, head_resource: str, timeout_s: float = 20.0):
    """The pending gang request the GCS reports for the placement group asking for `head_resource`."""
    from ray._raylet import GcsClient
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    gcs = GcsClient(address=emulated_cluster.address)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = get_cluster_resource_state(gcs)
        for gang in state.pending_gang_resource_requests:
            if any(head_resource in r.resources_bundle for r in gang.requests):
                return gang
        time.sleep(0.2)
    raise AssertionError(f"no pending gang request for {head_resource} within {timeout_s}s")


@pytest.mark.parametrize(
    ("demand", "hosts", "replicas"),
    [
        ("whole", 4, 1),
        pytest.param(
            "head",
            0,
            0,
            marks=pytest.mark.full(
                "CI: the same gap of the head demand, on a synthetic request (k8s/test_k8s_autoscale.py)"
            ),
        ),
    ],
)
def test_a_pending_4x4_reservation_becomes_one_kuberay_slice(
    emulated_cluster, pg_leak_check, monkeypatch, demand, hosts, replicas
) -> None:
    """ "whole" (what Ray's v2 autoscaler gets): the head by pod type and a companion on each of the 3 other
    hosts, strictly spread, is 4 hosts of the slice's worker group = one replica. "head" (what the v1
    autoscaler gets): a head selected by worker id 0 matches no worker group, so nothing starts (the gap
    of docs/autoscaling-k8s.md that Ray's own reservations still have)."""
    monkeypatch.setenv(SLICE_DEMAND_ENV, demand)
    # As on KubeRay, where Ray's v2 autoscaler runs: a shape the cluster lacks now is demand, not an error
    # (the emulated cluster here has no autoscaler of its own; tpuray's detection of one is replaced).
    monkeypatch.setattr(demand_module, "ray_autoscaler_runs", lambda: True)
    cfg = K8sConfig(
        "TPU-V6E", "4x4", num_slices=0, namespace="default", autoscale=AutoscaleConfig(max_slices=2)
    )
    topo, group = cfg.slice_topology, cfg.worker_group_name
    before = set(live_placement_groups())
    thread, out = in_thread(lambda: SlicePlacementGroup("4x4", "v6e", timeout_s=8))
    try:
        gang = _pending_gang(emulated_cluster, topo.head_resource)
    finally:
        thread.join(timeout=60)
    assert len(out) == 1 and isinstance(out[0], SliceReservationTimeout), out
    assert new_placement_groups(before) == {}  # the timed-out reservation released its heads' group

    bundles = [dict(r.resources_bundle) for r in gang.requests]
    spread = [len(r.placement_constraints) for r in gang.requests]
    if demand == "whole":
        assert bundles == [{topo.head_resource: 1.0}] + [{"memory": 1.0}] * 3 and spread == [1] * 4
    else:
        assert bundles == [{topo.head_resource: 1.0}] and spread == [0]
    launch, _ = _schedule(cfg, gangs=[gang])
    assert launch == ({group: hosts} if hosts else {}), launch
    provider, k8s = _provider(cfg)
    if hosts:
        _launch(provider, group, hosts, "pending-4x4")
    assert k8s.raycluster["spec"]["workerGroupSpecs"][0]["replicas"] == replicas


def test_slice_demand_follows_the_autoscaler_and_refuses_a_bad_value(emulated_cluster, monkeypatch) -> None:
    monkeypatch.delenv(SLICE_DEMAND_ENV, raising=False)
    assert slice_demand() == "head"  # the emulator's cluster runs no v2 autoscaler
    monkeypatch.setenv(SLICE_DEMAND_ENV, "slices")
    with pytest.raises(ConfigError, match=f"{SLICE_DEMAND_ENV}.*'slices'.*auto.*head.*whole"):
        slice_demand()
