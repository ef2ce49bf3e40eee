"""Kill and replace one emulated TPU host (a Ray node) of the shared emulated cluster.

Uses EmulatedCluster.kill_host / restore_host when the emulator provides them; otherwise the underlying
ray.cluster_utils.Cluster (remove_node) and the emulator's own host specs to re-add an identical host.
"""

from __future__ import annotations

from typing import Any


def kill_host(cluster: Any, node_id: str) -> Any:
    """Hard-kill the Ray node `node_id` (raylet + its workers); return what restore_host needs."""
    if hasattr(cluster, "kill_host"):
        return cluster.kill_host(node_id)
    for sl in cluster.slices:
        if node_id in sl.node_ids:
            worker_id = sl.node_ids.index(node_id)
            break
    else:
        raise AssertionError(f"node {node_id} is not an emulated TPU host of {cluster!r}")
    node = next(n for n in cluster._cluster.list_all_nodes() if n.node_id == node_id)
    cluster._cluster.remove_node(node, allow_graceful=False)
    return (sl, worker_id)


def restore_host(cluster: Any, token: Any) -> None:
    """Add a replacement host with the same slice name, worker id, resources and labels."""
    if hasattr(cluster, "restore_host"):
        cluster.restore_host(token)
        return
    sl, worker_id = token
    node = cluster._add_host(sl.hosts[worker_id])
    sl.node_ids[worker_id] = node.node_id
    cluster._cluster.wait_for_nodes()
