"""The node's QSDs: one by default, or several shards each serving its volumes from its own main loop.

QEMU 10.0 and 11.1 keep a vhost-user-blk export in QSD's main loop (an export
in an iothread aborts or corrupts descriptors when a VM connects or leaves
during a graph change; `features`), so one QSD serves every VM disk of a
node from one thread. Several QSD processes ("shards") give each its own
main loop: the node's VM disks spread over as many threads as there are
shards, and a QSD crash takes down only the volumes of its shard.

Each shard is a whole QSD under its own supervisor (`daemon.QSDDaemon`: its
own directory, pidfile, QMP socket, watchdog and rebuild), so adoption,
crash recovery and the watchdog work per shard unchanged. Shard 0 lives
where the single QSD always has, so a node that goes from one QSD to several
adopts the running one as shard 0. Which shard serves a staged volume is
recorded in its stage row and chosen by `place`; this module only keeps the
daemons and the map from volume to shard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.daemon import QSDDaemon, Rebuild, running_pid
from csi_qsd.qsd.settings import QSDMode, QSDSettings

MAX_SHARDS = 16

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    """One shard's settings: the node's, with a directory (and QMP client name) of its own."""

    base: QSDSettings
    index: int

    @property
    def node_id(self) -> str:
        return self.base.node_id if self.index == 0 else f"{self.base.node_id}-shard{self.index}"

    @property
    def qsd_dir(self) -> Path:
        return shard_dir(self.base.qsd_dir, self.index)

    def __getattr__(self, name: str) -> Any:
        """Every other setting is the node's (the binary, threads, timeouts, mode)."""
        if name in ("base", "index"):  # not set yet (copy, pickle): no recursion through self.base
            raise AttributeError(name)
        return getattr(self.base, name)


def shard_dir(qsd_dir: Path, index: int) -> Path:
    """Shard 0 is the node's one QSD of old (`qsd/`); shard k lives beside it (`qsd-k/`)."""
    return qsd_dir if index == 0 else qsd_dir.with_name(f"{qsd_dir.name}-{index}")


def check_count(count: int) -> None:
    """Raises ValueError for a shard count the driver does not run."""
    if not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"qsd-shards {count}: must be 1..{MAX_SHARDS}")


def place(key: str, count: int) -> int:
    """The shard for a placement key: stable across restarts and releases (CRC-32, not Python's hash)."""
    return zlib.crc32(key.encode()) % count


class QSDShards:
    """The supervised QSDs of a node and which one serves each staged volume."""

    def __init__(self, settings: QSDSettings, count: int = 1) -> None:
        check_count(count)
        self._settings = settings
        self.daemons = [QSDDaemon(ShardSettings(settings, index)) for index in range(count)]
        self._placed: dict[str, int] = {}

    @property
    def count(self) -> int:
        return len(self.daemons)

    @property
    def first(self) -> QSDDaemon:
        """Shard 0: the node's QSD of old; device pools, which one process must own, are opened here."""
        return self.daemons[0]

    @property
    def ready(self) -> bool:
        """Every shard answering: the node serves calls for any volume."""
        return all(daemon.ready for daemon in self.daemons)

    @property
    def version(self) -> tuple[int, int, int]:
        """QEMU's version, the same binary for every shard."""
        return self.first.version

    @property
    def loop_direct_io(self) -> bool:
        """Whether loop devices over FUSE exports use direct I/O: one answer for the node's one binary."""
        return self.first.loop_direct_io

    def place(self, volume_id: str, shard: int) -> None:
        """Record that `shard` serves `volume_id` (from its stage row)."""
        self._placed[volume_id] = shard

    def forget(self, volume_id: str) -> None:
        self._placed.pop(volume_id, None)

    def shard_of(self, volume_id: str) -> int:
        """The shard serving the volume; shard 0 for one not staged (nothing of it is open anywhere)."""
        return self._placed.get(volume_id, 0)

    def of(self, volume_id: str) -> QSDDaemon:
        return self.daemons[self.shard_of(volume_id)]

    def client_of(self, volume_id: str) -> QSDClient:
        return self.of(volume_id).client

    async def start(self, rebuild: Callable[[int], Rebuild]) -> None:
        """Bring every shard up (adopt or spawn, rebuild its volumes), all at once; raises if any cannot be.

        `rebuild(index)` is the graph rebuild of one shard. On failure the
        shards already up stop being supervised (their QSDs keep running).
        """
        results = await asyncio.gather(
            *(daemon.start(rebuild(index)) for index, daemon in enumerate(self.daemons)), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.close()
            raise failures[0]

    async def stop_beyond(self) -> list[int]:
        """Stop the QSDs of shards past `count` that a driver with more shards left running (managed mode).

        Only once no stage row names them (`csi_qsd.server.placed` checks):
        they serve nothing, and nobody would supervise them. Returns their
        former PIDs.
        """
        if self._settings.qsd_mode is not QSDMode.MANAGED:
            return []  # qsd-run keeps those of an external QSD container
        stopped = []
        for index in range(self.count, MAX_SHARDS):
            settings = ShardSettings(self._settings, index)
            pid = running_pid(settings)
            if pid is not None:
                log.warning("event=qsd_shard_stopped shard=%d pid=%d reason=beyond_qsd_shards count=%d",
                            index, pid, self.count)
                await QSDDaemon(settings).shutdown()
                stopped.append(pid)
        return stopped

    async def close(self) -> None:
        """Stop supervising every shard; the QSDs keep running."""
        await asyncio.gather(*(daemon.close() for daemon in self.daemons))

    async def shutdown(self) -> None:
        """Stop supervising and stop every shard's QSD."""
        await asyncio.gather(*(daemon.shutdown() for daemon in self.daemons))
