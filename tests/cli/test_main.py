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
