"""The `tpuray` entry points: `python -m tpuray`, and which errors print one line vs a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tpuray import cli
from tpuray.optional import MissingDependency, require
from tpuray.validation import ConfigError


def test_python_dash_m_tpuray() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tpuray", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "usage: tpuray" in proc.stdout and "emulate" in proc.stdout


def _fake_command(monkeypatch, error: BaseException) -> None:
    def register(sub: argparse._SubParsersAction) -> None:
        def run(args: argparse.Namespace) -> int:
            raise error

        sub.add_parser("boom").set_defaults(func=run)

    real = cli.build_parser

    def build() -> argparse.ArgumentParser:
        parser = real()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        register(sub)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("topology '3x5' is not valid"),
        cli.UsageError("bad flag"),
        MissingDependency("needs pandas"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, error) -> None:
    _fake_command(monkeypatch, error)
    assert cli.main(["boom"]) == 2
    assert capsys.readouterr().err == f"tpuray boom: error: {error}\n"


@pytest.mark.parametrize("error", [ValueError("internal bug"), KeyError("x"), RuntimeError("y")])
def test_internal_errors_keep_their_traceback(monkeypatch, error) -> None:
    _fake_command(monkeypatch, error)
    with pytest.raises(type(error)):
        cli.main(["boom"])


def test_missing_optional_dependency_names_the_extra() -> None:
    with pytest.raises(
        MissingDependency, match=r"Result.metrics_dataframe needs the 'nopandas' package.*tpuray\[train\]"
    ):
        require("nopandas.core", "train", "Result.metrics_dataframe")
    assert require("json", "train", "x").dumps([1]) == "[1]"


SHAPE = ["-a", "TPU-V6E", "-t", "2x2"]


@pytest.mark.parametrize(
    "command", [["plan", *SHAPE], ["k8s", *SHAPE], ["emulate", "up", *SHAPE], ["emulate", "status", *SHAPE]]
)
def test_every_subcommand_takes_the_same_slice_flags(command) -> None:
    """-a/-t and --accelerator-type/--topology mean the same in every subcommand that takes a shape."""
    short = cli.build_parser().parse_args(command)
    spelled = {"-a": "--accelerator-type", "-t": "--topology"}
    long = cli.build_parser().parse_args([spelled.get(w, w) for w in command])
    assert (
        (short.accelerator_type, short.topology)
        == (long.accelerator_type, long.topology)
        == ("TPU-V6E", "2x2")
    )


def test_an_unknown_flag_is_refused_under_the_subcommands_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["emulate", "up", "--bogus", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: tpuray emulate" in err
    assert "tpuray emulate: error: unrecognized arguments: --bogus 1" in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", *SHAPE, "--num-slices", "0"], "--num-slices=0 is invalid"),
        (["plan", *SHAPE, "--chips-per-process", "3"], "--chips-per-process=3 does not tile"),
        (["k8s", *SHAPE, "-n", "0"], "--num-slices=0 is invalid"),
    ],
)
def test_errors_name_the_flag_not_the_parameter(capsys, argv, words) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "num_slices" not in err and "chips_per_process" not in err


def test_serve_refuses_a_slice_config_with_no_cluster(tmp_path, monkeypatch, capsys) -> None:
    """No --address, RAY_ADDRESS or emulated cluster: a config that needs a slice fails at once, naming the
    shape and how to get one (instead of a local Ray with no TPU, waiting forever)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4}'
    )
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"llm_configs:\n  - model_loading_config: {{model_id: m, model_source: {model}}}\n"
        "    accelerator_type: TPU-V6E\n    accelerator_config: {kind: tpu, topology: 2x2}\n"
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["serve", str(config), "--state-dir", str(tmp_path / "none"), "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "needs a TPU-V6E 2x2 TPU slice and no Ray cluster is running" in err
    assert "tpuray emulate up -a TPU-V6E -t 2x2" in err


def test_serve_help_says_it_runs_in_the_foreground(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "foreground until Ctrl-C" in out and "nohup tpuray serve" in out
