"""A compiled runner's step programs kept whole on the host's disk (embedded/programs.py): a second start
loads every program and compiles none, with the same tokens; an unreadable entry is compiled again; a
backend whose programs cannot be saved, or the cache off, leaves the disk alone. Inductor stands in for
torch_tpu on the CPU (both return programs torch can serialize); tests/real_tpu does the same on a chip."""

from __future__ import annotations

import re

import pytest

from _util import runner_start
from tpuray.serve.llm.engine.embedded.runner import ModelRunner
from tpuray.serve.llm.engine.embedded.step_plan import Buckets


def test_a_second_start_loads_every_program_and_a_bad_one_is_compiled_again(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    first = runner_start(tiny_model_dir, cache, "cpu", "inductor")
    n = first["programs"]
    assert first["compiled"] == first["warmup_compiled"] == n and first["loaded"] == 0
    assert f"warm-up: program {n} of {n} (" in first["stderr"] and ") compiled in " in first["stderr"]
    saved = sorted((cache / "programs").rglob("*.bin"))
    assert len(saved) == n, saved
    torch_aot_cache = tmp_path / "cache-torch" / "aotautograd"  # the store saved them; torch's cache not
    assert not (torch_aot_cache.exists() and any(torch_aot_cache.rglob("*"))), list(
        torch_aot_cache.rglob("*")
    )
    second = runner_start(tiny_model_dir, cache, "cpu", "inductor", load_workers=2)  # read by 2 threads
    assert second["compiled"] == 0 and second["loaded"] == second["preloaded"] == n
    assert ") loaded in " in second["stderr"] and ") compiled in " not in second["stderr"]
    assert second["tokens"] == first["tokens"]

    # one start meets both kinds of bad entry; every other program still loads
    prefill, decode, other_decode = saved[-1], saved[0], saved[1]  # sorted: decode-*, then prefill-*
    assert prefill.name.startswith("prefill") and other_decode.name.startswith("decode") and n >= 3
    other_decode.write_bytes(b"not a program" * 8)
    prefill.write_bytes(decode.read_bytes())  # a program saved for other inputs: its guards refuse them
    third = runner_start(tiny_model_dir, cache, "cpu", "inductor")  # each read at its first call
    assert third["compiled"] == 2 and third["loaded"] == n - 2
    assert re.search(
        rf"{re.escape(str(other_decode))} unreadable \(.*\); compiling it again", third["stderr"]
    )
    assert f"{prefill.stem} was saved for other inputs; compiling it again" in third["stderr"]
    assert third["tokens"] == first["tokens"]


def _runner(path: str, backend: str, **kwargs) -> ModelRunner:
    buckets = Buckets(batch=(1,), tokens=(16,), context=(32,), prefill_seqs=1)
    return ModelRunner(
        path,
        max_num_seqs=1,
        max_model_len=32,
        compile=True,
        compile_backend=backend,
        buckets=buckets,
        **kwargs,
    )


def test_programs_of_a_backend_that_cannot_save_them_stay_in_memory(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TPURAY_COMPILE_CACHE", str(tmp_path / "cache"))
    runner = _runner(tiny_model_dir, "eager")  # Dynamo's eager backend: a debugging backend, not saved
    assert runner.programs is not None and runner.programs.store is None
    assert runner.warmup() == runner.buckets.num_programs and runner.loaded_programs == 0
    assert not (tmp_path / "cache").exists()
    assert set(runner.warmup_phases) == {"read", "build", "save", "run"}
    assert sum(runner.warmup_phases.values()) == pytest.approx(runner.warmup_s, rel=0.01)
    runner.programs.close()  # the programs dropped, and not again at exit
    assert runner.programs.compiled == runner.buckets.num_programs


def test_load_workers_must_be_a_positive_integer(tiny_model_dir):
    with pytest.raises(ValueError, match=r"load_workers=0 is not valid; valid: an integer >= 1"):
        ModelRunner(tiny_model_dir, max_num_seqs=1, max_model_len=32, load_workers=0)


@pytest.mark.parametrize(
    "cache, words",
    [
        ("on", r"needs compile_backend in \('tpu-donate',\).*got compile_backend='inductor'"),
        ("off", "nothing saved"),
    ],
)
def test_async_compile_is_refused_where_it_cannot_apply(tiny_model_dir, tmp_path, monkeypatch, cache, words):
    monkeypatch.setenv("TPURAY_COMPILE_CACHE", str(tmp_path / "cache") if cache == "on" else "off")
    with pytest.raises(ValueError, match=f"async_compile=True .*{words}"):
        _runner(tiny_model_dir, "inductor", async_compile=True)


def test_with_the_cache_off_nothing_is_saved(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TPURAY_COMPILE_CACHE", "off")
    monkeypatch.chdir(tmp_path)
    runner = _runner(tiny_model_dir, "inductor")
    assert runner.programs is not None and runner.programs.store is None
    assert runner.warmup() == runner.buckets.num_programs
    assert not list(tmp_path.rglob("*.bin"))


def test_load_workers_and_async_compile_are_refused_on_an_eager_runner(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^load_workers=2 applies to a compiled runner"):
        ModelRunner(tiny_model_dir, max_num_seqs=1, max_model_len=32, load_workers=2)
    with pytest.raises(
        ValueError, match=r"^load_workers=2 and async_compile=True apply to a compiled runner"
    ):
        ModelRunner(tiny_model_dir, max_num_seqs=1, max_model_len=32, load_workers=2, async_compile=True)
