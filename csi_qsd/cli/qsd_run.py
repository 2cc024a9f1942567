"""`csi-qsd qsd-run`: qemu-storage-daemon in the foreground, in a container of its own (external mode)."""

from __future__ import annotations

import argparse

from csi_qsd.cli.common import Subcommands, common_flags, config_from, setup_logging
from csi_qsd.config import Config
from csi_qsd.qsd import shards


def add_parser(sub: Subcommands) -> None:
    run = sub.add_parser("qsd-run", help="run qemu-storage-daemon in the foreground (its own container)")
    common_flags(run)



def _qsd_run(config: Config) -> int:
    from csi_qsd.qsd import foreground

    return foreground.run([shards.ShardSettings(config, index) for index in range(config.qsd_shards)])


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    setup_logging(config.log_level)
    return _qsd_run(config)
