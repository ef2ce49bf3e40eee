"""The flags several subcommands share, defined once: one spelling, short form, metavar and help for the
same thing in every subcommand (`tpuray plan`, `emulate`, `k8s`, `status`, `serve`), and `name_flags`,
which makes an error raised by the library name the flag the user typed instead of the Python parameter
behind it (`--num-slices=0`, not `num_slices=0`)."""

from __future__ import annotations

import argparse
import re

ACCELERATOR_HELP = "TPU generation, e.g. TPU-V6E, v5e, v5p, v4, tpu7x (case-insensitive)"
TOPOLOGY_HELP = "slice topology, e.g. 2x2, 4x4 (v5e/v6e) or 2x2x2 (v4/v5p/v7x)"


def add_slice_shape(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    accelerator_type: str | None = None,
    topology: str | None = None,
) -> None:
    """--accelerator-type/-a and --topology/-t: required where no default is given."""
    p.add_argument(
        "--accelerator-type",
        "-a",
        metavar="TYPE",
        required=accelerator_type is None,
        default=accelerator_type,
        help=ACCELERATOR_HELP + (f" (default {accelerator_type})" if accelerator_type else ""),
    )
    p.add_argument(
        "--topology",
        "-t",
        metavar="AxB[xC]",
        required=topology is None,
        default=topology,
        help=TOPOLOGY_HELP + (f" (default {topology})" if topology else ""),
    )


def add_num_slices(p: argparse.ArgumentParser, *, default: int | None, help: str) -> None:
    p.add_argument("--num-slices", "-n", type=int, default=default, metavar="N", help=help)


def add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        default=None,
        help="the Ray cluster (default: RAY_ADDRESS, else the running `tpuray emulate` cluster)",
    )


def add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        default=None,
        help="where `tpuray emulate` records its running cluster (default ~/.tpuray/emulator)",
    )


def name_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """`message` with each `param=` (or `param >= `, `param < `...) that a flag of `parser` sets written
    as that flag (`--flag=`)."""
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest != "help":
            message = re.sub(
                rf"(?<![\w\-\[']){re.escape(action.dest)}(=| [<>]=? )", rf"{longs[0]}\1", message
            )
    return message


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser (its flags, its usage line)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def cluster_address(address: str | None, state_dir: str | None) -> str | None:
    """What --address resolves to: the flag, else RAY_ADDRESS, else the running `tpuray emulate`
    cluster's address; None when there is none of them."""
    import os

    from tpuray.emulator import detached

    if address or os.environ.get("RAY_ADDRESS"):
        return address or os.environ["RAY_ADDRESS"]
    state = detached.read_state(state_dir)
    return state["address"] if state is not None else None
