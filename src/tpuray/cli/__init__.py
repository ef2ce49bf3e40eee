"""`tpuray` command line. Each subcommand lives in its own module exposing `register(subparsers)`,
which adds its parser and sets `func(args) -> int` as the default."""

from __future__ import annotations

import argparse
import importlib
import sys

from tpuray.optional import MissingDependency
from tpuray.validation import ConfigError

# Order is the order shown in `tpuray --help`.
COMMANDS = ("demo", "plan", "emulate", "status", "serve", "k8s")


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpuray",
        description=(
            "Native PyTorch on TPU slices with Ray. Plans slices, runs emulated TPU slices on any CPU "
            "machine, serves LLMs and writes KubeRay manifests."
        ),
    )
    from tpuray import __version__

    parser.add_argument("--version", action="version", version=f"tpuray {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tpuray.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tpuray.cli.flags import command_parser, name_flags

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 0
    command = command_parser(parser, args.command)
    if unknown:  # under the subcommand's usage, which lists what it takes
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except (
        UsageError,
        ConfigError,
        MissingDependency,
    ) as e:  # bad input: one line naming the flag; anything else keeps its traceback
        print(f"tpuray {args.command}: error: {name_flags(str(e), command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
