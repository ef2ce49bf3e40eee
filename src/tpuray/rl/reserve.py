"""What an RL run reserves, before it starts anything: the slices each side needs (the rollout engine's
one slice when disaggregated, the trainer's num_slices), checked against the cluster, then claimed in
one request (tpuray.slices.claim) so that both sides' reservations take claimed slices."""

from __future__ import annotations

from tpuray.rl.config import RLConfig
from tpuray.slices.claim import SliceClaim
from tpuray.topology import SliceTopology


def slice_shapes(config: RLConfig) -> list[tuple[SliceTopology, int]]:
    """(shape, number of slices) of each side that reserves slices of its own: the rollout engine's
    when disaggregated (colocated, it runs in the trainer's workers), then the trainer's."""
    rollout, trainer = config.rollout, config.trainer
    assert trainer.slice_topology is not None and trainer.num_slices is not None  # RLConfig checked
    shapes = [(trainer.slice_topology, trainer.num_slices)]
    if config.placement == "disaggregated":
        assert rollout.accelerator_type is not None and rollout.topology is not None
        shapes.insert(0, (SliceTopology.parse(rollout.accelerator_type, rollout.topology), 1))
    return shapes


def capacity_shortfall(config: RLConfig) -> str | None:
    """Why the cluster cannot hold both sides' slices at once (intact, not draining), listing its
    slices; None when it can. Reserves nothing."""
    from tpuray.slices.inventory import format_slices, list_slices

    need: dict[str, int] = {}
    for topo, count in slice_shapes(config):
        need[topo.pod_type] = need.get(topo.pod_type, 0) + count
    slices = list_slices()
    for pod, n in need.items():
        have = sum(1 for s in slices if s.pod_type == pod and s.intact and not s.draining)
        if have < n:
            return (
                f"the RL run needs {n} x {pod} slice(s) at once (the rollout engine's and the trainer's); "
                f"this cluster has {have}; nothing was reserved. TPU slices:\n{format_slices(slices)}"
            )
    return None


def claim_slices(config: RLConfig) -> SliceClaim | None:
    """Disaggregated: both sides' slices claimed in one placement group, waiting as long as the shorter
    of the two sides' reservation timeouts (SliceReservationTimeout, nothing held, if they cannot be had
    at once). Colocated: None (one side reserves)."""
    from tpuray.train.worker import reserve_timeout_s

    if config.placement != "disaggregated":
        return None
    timeout_s = min(config.rollout.reservation_timeout_s, reserve_timeout_s())
    return SliceClaim(slice_shapes(config), timeout_s=timeout_s, name="tpuray-rl-claim").open()
