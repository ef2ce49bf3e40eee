"""Shared pytest fixtures: real local Ray clusters made of emulated TPU hosts (never mocks).

Fixtures
--------
emulated_cluster (session)
    A running `tpuray.emulator.EmulatedCluster`: CPU-only head (4 CPUs, drivers / Serve) + TWO v6e 2x2
    slices (one 4-chip host each, 8 logical CPUs per host), with this test process `ray.init`-ed to it.
    Use it from function, module or session fixtures:

        def test_x(emulated_cluster):
            emulated_cluster.slices[0].name       # "emulated-v6e-4-0"
            ray.get(f.options(resources={"TPU": 1}).remote())

cluster_manager (session)
    Swaps layouts: `cluster_manager.get(SliceRequest("TPU-V5E", "2x2", count=2))` shuts the current
    cluster down (ray.shutdown + every node), starts the requested one and connects; it keeps the current
    cluster when the layout already matches (and its head has >= `head_cpus`). `cluster_manager.get()`
    (no args) is the default layout.
    Tests that request `cluster_manager` but not `emulated_cluster` are run after all other tests, so the
    default cluster is restarted at most once; the default is restarted lazily for any later test using
    `emulated_cluster`.

pg_leak_check (function)
    After the test, asserts that no placement group created during the test is still alive
    (`ray.util.placement_group_table()`); yields a callable to run the same check mid-test.

At session end the connection is closed and every node (raylets, GCS, workers) is stopped.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator

import pytest

from _util import live_placement_groups, new_placement_groups
from tpuray.emulator import EmulatedCluster, SliceRequest
from tpuray.emulator.hosts import QUIET_RAY_ENV

# Nothing here may download from a hub (the machines have no internet): Hugging Face reads its cache only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Compiled programs the suite saves (tpuray.serve.llm.engine.compile_cache) stay out of the home directory.
if "TPURAY_COMPILE_CACHE" not in os.environ:
    import tempfile

    os.environ["TPURAY_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="tpuray-test-compile-")

# The suite runs two emulated clusters on two cores for its whole length and no test reads Ray's node
# stats or metrics: every Ray process it starts inherits Ray's quiet settings (bench_idle_cluster.py).
for _name, _value in QUIET_RAY_ENV.items():
    os.environ.setdefault(_name, _value)

# `make test` runs the suite on two pytest-xdist workers, each with its own emulated cluster
# (pytest_xdist_make_scheduler below): these modules (vLLM apps, 16-worker 4x4 slices: the suite's
# memory peaks, several GB each) are one unit of work, run first and in order by one worker, so no two
# peaks meet; every other module is a unit of its own, taken by whichever worker is free.
HEAVY_MODULES = frozenset(
    {
        "serve/backends/test_vllm.py",
        "serve/test_ray_serve_llm.py",
        "emulator/test_autoscale.py",
        "serve/backends/test_engine_proof.py",
        "rl/rollout/test_vllm_rollout.py",
        "train/test_ray_train.py",
        "train/test_data.py",
        "slices/test_layouts.py",  # light, but its 4x4 layout is then the one test_data's and Ray Train's 4x4 use
    }
)
# other modules with layout-swapping tests (cluster_manager without emulated_cluster): one unit, given out
# last, so that a worker swaps its cluster's layout as few times as it can
SWAPPING_MODULES = frozenset({"serve/test_model_source.py"})
DEFAULT_LAYOUT: tuple[SliceRequest, ...] = (SliceRequest("TPU-V6E", "2x2", count=2),)
TEST_NAMESPACE = "tpuray-tests"


class ClusterManager:
    """Keeps at most one emulated cluster running; one EmulatedCluster object per layout."""

    def __init__(self) -> None:
        self._clusters: dict[tuple, EmulatedCluster] = {}
        self.current: EmulatedCluster | None = None

    def get(self, *requests: SliceRequest, head_cpus: int = 4) -> EmulatedCluster:
        import ray

        requests = requests or DEFAULT_LAYOUT
        wanted = EmulatedCluster(list(requests), head_cpus=head_cpus)
        layout = tuple(sorted(r.key() for r in wanted.requests))
        cluster = self._clusters.setdefault(layout, wanted)
        if cluster.head_cpus < head_cpus:  # a bigger head is fine; a smaller one is not
            if cluster is self.current:
                cluster.shutdown()
            cluster.head_cpus = head_cpus
        if self.current is not cluster or not cluster.running:
            if self.current is not None:
                self.current.shutdown()
                self.current = None
            cluster.start()
            self.current = cluster
        if not ray.is_initialized():
            cluster.connect(namespace=TEST_NAMESPACE)
        return cluster

    def shutdown(self) -> None:
        import ray

        if self.current is not None:
            self.current.shutdown()
            self.current = None
        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="session")
def cluster_manager() -> Iterator[ClusterManager]:
    manager = ClusterManager()
    try:
        yield manager
    finally:
        manager.shutdown()


@pytest.fixture(scope="session")
def emulated_cluster(cluster_manager: ClusterManager) -> EmulatedCluster:
    return cluster_manager.get()


@pytest.fixture(autouse=True)
def _default_layout_guard(request: pytest.FixtureRequest) -> None:
    """Restart the default cluster (lazily) if an earlier test swapped the layout."""
    if "emulated_cluster" in request.fixturenames:
        request.getfixturevalue("cluster_manager").get()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run layout-swapping tests (cluster_manager without emulated_cluster) last, in their order."""

    def swaps(item: pytest.Item) -> bool:
        names = getattr(item, "fixturenames", ())
        return "cluster_manager" in names and "emulated_cluster" not in names

    items.sort(key=swaps)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `pytest -n N`: HEAVY_MODULES are one unit of work, given out first; SWAPPING_MODULES one unit,
    given out last; every other module a unit of its own, to whichever worker is free (a balance of the
    workers' time that a fixed split cannot keep). pytest-xdist's own `--dist loadgroup` cannot tag items
    under pytest 9."""
    from xdist.scheduler import LoadScopeScheduling

    def unit(nodeid: str) -> str:
        module = nodeid.split("::", 1)[0].removeprefix("tests/")
        return "heavy" if module in HEAVY_MODULES else "swaps" if module in SWAPPING_MODULES else module

    class Units(OrderedDict):
        """xdist's work queue, handing out the heavy unit first and the swapping one last."""

        def popitem(self, last: bool = True):
            for scope in ("heavy", *(k for k in self if k != "swaps"), "swaps"):
                if scope in self:
                    return scope, self.pop(scope)
            raise KeyError("popitem(): no units left")

    class HeavyFirst(LoadScopeScheduling):
        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            self.workqueue = Units()

        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    config.option.loadscopereorder = False
    return HeavyFirst(config, log)


@pytest.fixture
def pg_leak_check() -> Iterator[Callable[[], None]]:
    before = set(live_placement_groups())

    def check() -> None:
        # Removal is an async GCS update: allow it a moment to land, then require it.
        leaked = new_placement_groups(before, timeout_s=10.0)
        summary = {k: (v.get("name"), v.get("state"), v.get("bundles")) for k, v in leaked.items()}
        assert not leaked, f"leaked placement groups: {summary}"

    yield check
    check()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Say which tier ran: CI's `make test` leaves the `full` scenarios out (pyproject.toml's markers)."""
    tier = config.option.markexpr
    if "full" in tier:
        terminalreporter.write_line(
            f"test tier: -m {tier!r}"
            + (
                ""
                if tier == "full or not full"
                else " (the scenarios marked `full` are left out: make test-all)"
            )
        )
