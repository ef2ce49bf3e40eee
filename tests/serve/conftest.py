"""Fixtures for tpuray.serve tests: a tiny local Llama-style model (16 heads: TP 1/2/4/8/16 all divide) and
one Ray Serve instance shared by every module here.

tiny_server (module)
    The tiny model's embedded-engine backend in this process (no Ray, no HTTP): `_configs.in_process_server`.

serve_url (module)
    Ray Serve's controller and HTTP proxy (on the CPU head, 127.0.0.1) on the default emulated cluster,
    started by the first module that asks and shut down after the last test of this directory (not once
    per module: each start is a controller and a proxy process). A module deploys its apps under its own
    names and deletes them when it is done, so the next module finds Serve empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from _util import free_port

HERE = Path(__file__).parent
_SERVE: dict[str, str] = {}  # address of the cluster Serve runs on, and its URL


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    from _configs import in_process_server

    s = in_process_server("tiny", tiny_model_dir)
    yield s
    s.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tpuray.models import build_tiny_causal_lm

    return str(
        build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llm") / "model", max_position_embeddings=512)
    )


@pytest.fixture(scope="module")
def serve_url(emulated_cluster, cluster_manager) -> Iterator[str]:
    from ray import serve

    # the default layout, running: module fixtures are set up before the function-scoped guard that
    # restarts it after a module on this worker swapped layouts (tests/conftest.py)
    cluster = cluster_manager.get()
    if _SERVE.get("address") != cluster.address:  # first use, or the cluster was restarted
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        _SERVE.update(address=cluster.address, url=f"http://127.0.0.1:{port}")
    yield _SERVE["url"]
    leftover = list(serve.status().applications)
    for name in leftover:  # the next module must find Serve empty, whatever happened here
        serve.delete(name)
    assert not leftover, f"a serve test module left its apps running: {leftover}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test here (module fixtures torn down first): shut the shared Serve instance down."""
    try:
        return (yield)
    finally:
        if _SERVE and (nextitem is None or HERE not in Path(nextitem.path).parents):
            _shutdown_serve()


def _shutdown_serve() -> None:
    import ray

    from tpuray.serve.shutdown import shutdown_serve

    address = _SERVE.pop("address", None)
    _SERVE.clear()
    if ray.is_initialized() and ray.get_runtime_context().gcs_address == address:
        shutdown_serve()
