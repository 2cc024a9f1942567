"""`csi-qsd`: the parser of every command, and `main`, which runs the one named.

Each command is a module of this package with `add_parser(sub)` and
`run(args) -> exit status`; a new command is a module and a line in
`COMMANDS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType

from csi_qsd import __version__
from csi_qsd.cli import metadata_router, qsd_run, qsd_stop, serve, volume

# In the order `csi-qsd --help` lists them.
COMMANDS: dict[str, ModuleType] = {
    "serve": serve,
    "snapshot-metadata-router": metadata_router,
    "qsd-run": qsd_run,
    "qsd-stop": qsd_stop,
    "volume": volume,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csi-qsd", description="CSI driver on qemu-storage-daemon")
    parser.add_argument("--version", action="version", version=f"csi-qsd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = COMMANDS[args.command].run(args)
    return status
