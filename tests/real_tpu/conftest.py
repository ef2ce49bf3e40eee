"""The real-TPU suite (marker `real_tpu`): runs where torch_tpu can open a TPU chip, skips elsewhere.

Run it in ONE process (only one process at a time can hold a chip), without Ray or an installed tpuray:

    make test-tpu          # or: PYTHONPATH=src python3 -m pytest -q tests/real_tpu --confcutdir=tests/real_tpu

Set TPURAY_TORCH_TPU_USABLE=1 where you know the chip is there, to skip tpuray's probe subprocess.
Tests that compare numbers with the CPU set float32 matmuls to the highest precision.
"""

from __future__ import annotations

import pytest

_reason: str | None = None


def _skip_reason() -> str | None:
    global _reason
    if _reason is None:
        from tpuray.runtime.detect import torch_tpu_installed, torch_tpu_usable

        if not torch_tpu_installed():
            _reason = "torch_tpu is not installed (real-TPU tests run on a TPU VM: docs/real-tpu.md)"
        elif not torch_tpu_usable():
            _reason = "torch_tpu is installed but finds no usable TPU chip here"
        else:
            _reason = ""
    return _reason or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if "real_tpu" in item.nodeid.split("::")[0]]
    if not mine:
        return
    reason = _skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.real_tpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tpu():
    """torch.device("tpu") of the real chip (tpuray.runtime activated: "real")."""
    import torch

    from tpuray.runtime import activate

    assert activate() == "real"
    return torch.device("tpu")


@pytest.fixture
def highest_precision():
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module")
def process_group(tpu, tmp_path_factory):
    """A one-rank `tpu_dist` default process group on the chip (DDP, FSDP2, collectives)."""
    import torch.distributed as dist

    init = f"file://{tmp_path_factory.mktemp('pg') / 'store'}"
    dist.init_process_group("tpu_dist", init_method=init, rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def embedded_greedy():
    """`greedy(path, prompt, n, **runner_kwargs)`: n greedy tokens of the embedded engine's ModelRunner
    (one sequence, each step read back), the reference the vLLM tests compare with."""
    from tpuray.serve.llm.engine.embedded.runner import ModelRunner

    def greedy(path: str, prompt: list[int], n: int, **kw) -> list[int]:
        runner = ModelRunner(path, max_num_seqs=4, max_model_len=256, **kw)
        ids, res = [], runner.step([(0, prompt, 0, None)], need_logits=False)
        for i in range(n - 1):
            assert res is not None
            ids.append(res.token_ids[0])
            res = runner.step([(0, [ids[-1]], len(prompt) + i, None)], need_logits=False)
        assert res is not None
        return [*ids, res.token_ids[0]]

    return greedy
