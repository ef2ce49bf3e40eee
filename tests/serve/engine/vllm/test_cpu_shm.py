"""The names of vLLM's CPU all-reduce segments removed once joined (serve/llm/engine/vllm/cpu_shm.py): one
group's or one engine's, whatever characters the names hold, and no other's. The engines themselves are
checked in serve/backends/test_vllm.py (TP=4 on an emulated slice) and rl/rollout/test_vllm_colocated.py."""

from __future__ import annotations

from tpuray.serve.llm.engine.vllm.cpu_shm import release_cpu_shm, release_engine_cpu_shm


def _segments(root, *names: str) -> None:
    for name in names:
        for rank in (0, 1):
            (root / f"{name}_{rank}").write_bytes(b"x")


def _left(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_groups_segments_are_removed_and_no_other_groups(tmp_path):
    ours, other = "tpuray123-tp:0-[0-1]-cpushm", "tpuray456-tp:0-[0-1]-cpushm"
    _segments(tmp_path, ours, other)
    release_cpu_shm([ours, ours], root=tmp_path)
    assert _left(tmp_path) == [f"{other}_0", f"{other}_1"]


def test_an_engines_segments_are_removed_by_its_port_and_no_other_engines(tmp_path):
    _segments(tmp_path, "45557-tp:0-[0-1]-cpushm", "45557-pp:0-[0-1]-cpushm", "455570-tp:0-[0-1]-cpushm")
    release_engine_cpu_shm("45557", root=tmp_path)
    assert _left(tmp_path) == ["455570-tp:0-[0-1]-cpushm_0", "455570-tp:0-[0-1]-cpushm_1"]
    release_engine_cpu_shm("//", root=tmp_path)  # the external launcher's "env://": no port, nothing
    assert len(_left(tmp_path)) == 2
