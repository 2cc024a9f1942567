"""`csi-qsd qsd-stop`: stop the qemu-storage-daemon of a state dir, which outlives `csi-qsd serve` by design."""

from __future__ import annotations

import argparse
import asyncio
import socket
from pathlib import Path

from csi_qsd.cli.common import Subcommands, option, setup_logging
from csi_qsd.cli.for_people import for_a_person
from csi_qsd.config import DEFAULT_STATE_DIR, Config
from csi_qsd.errors import FailedPrecondition
from csi_qsd.qsd import shards


def add_parser(sub: Subcommands) -> None:
    stop = sub.add_parser("qsd-stop", help="stop the qemu-storage-daemon of a state dir: it outlives `csi-qsd "
                          "serve` by design, so volumes stay served across driver restarts")
    option(stop, "--state-dir", str(DEFAULT_STATE_DIR), "the driver's state dir (catalog, QSD's pidfile and socket)")
    option(stop, "--endpoint", "", "the driver's CSI endpoint, which must not be served: a running driver "
            "would start QSD again (default: unix://<state-dir>/csi.sock)")
    stop.add_argument("--force", action="store_true",
                      help="stop it even while the catalog records staged volumes: the pods and VMs using them "
                           "lose their disks (their I/O fails)")



async def _qsd_stop(args: argparse.Namespace) -> int:
    """Stop the QSD of a state dir: QMP `quit`, wait, then SIGKILL (the supervisor's own shutdown).

    Refused (FailedPrecondition) while a driver serves the endpoint, which
    would start QSD again, and while the catalog records staged volumes,
    unless --force. Raises QSDError if QSD survives SIGKILL.
    """
    from csi_qsd.catalog import Catalog
    from csi_qsd.qsd.daemon import QSDDaemon

    config = Config(state_dir=Path(args.state_dir), endpoint=args.endpoint)
    pids = qsd_pids(config)
    if not pids:
        print(f"no qemu-storage-daemon runs for {config.state_dir}")
        return 0
    if _accepts(config.socket_path):
        raise FailedPrecondition(f"a driver still serves {config.endpoint}: stop `csi-qsd serve` first, "
                                 "or it starts qemu-storage-daemon again")
    staged: list[str] = []
    if config.catalog_path.exists():
        async with Catalog(config.catalog_path) as catalog:
            staged = [record.volume_id for record in await catalog.stages()]
    if staged and not args.force:
        raise FailedPrecondition(
            f"the catalog records {len(staged)} staged volume(s) ({', '.join(staged)}): stopping "
            "qemu-storage-daemon takes their disks from the pods and VMs using them; unstage them first, "
            "or pass --force")
    for shard, pid in pids.items():
        await QSDDaemon(shards.ShardSettings(config, shard)).shutdown()
        print(f"stopped qemu-storage-daemon (pid {pid}) of {config.state_dir}" + (f", shard {shard}" if shard else ""))
    return 0


def qsd_pids(config: Config) -> dict[int, int]:
    """The live QSD of every shard of a state dir, by shard (whatever --qsd-shards a driver ran with)."""
    from csi_qsd.qsd.daemon import running_pid

    found = {shard: running_pid(shards.ShardSettings(config, shard)) for shard in range(shards.MAX_SHARDS)}
    return {shard: pid for shard, pid in found.items() if pid is not None}


def _accepts(path: Path) -> bool:
    """True while something listens on the UNIX socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def run(args: argparse.Namespace) -> int:
    setup_logging("warning")
    return for_a_person(lambda: asyncio.run(_qsd_stop(args)))
