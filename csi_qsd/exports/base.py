"""The export-path interface and what every kind is given to work with.

A kind brings a staged volume up and down (QSD export and whatever the host
needs on top of it), publishes it to pod targets, reports its condition and
usage, grows it, and quiesces it for a snapshot. It never touches the
catalog: the orchestrator passes in the rows it needs and commits what the
kind returns. No gRPC types here.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import ClassVar

from csi_qsd.catalog import PublishRecord, StageRecord, VolumeRecord
from csi_qsd.errors import InvalidArgument
from csi_qsd.params import ExportKind
from csi_qsd.pools.base import Pool
from csi_qsd.qsd import attach
from csi_qsd.qsd import move as qsd_move
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.daemon import QSDDaemon
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.volume_keys import KeyStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VolumeStats:
    block: bool
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int = 0
    available_inodes: int = 0
    used_inodes: int = 0
    abnormal: bool = False
    message: str = ""

    @classmethod
    def restarting(cls, capacity: int) -> "VolumeStats":
        """What a volume reports while QSD is away: its size, and that I/O waits."""
        return cls(block=True, total_bytes=capacity, available_bytes=0, used_bytes=0, abnormal=True,
                   message="qemu-storage-daemon is restarting; I/O will resume when it is back")


@dataclasses.dataclass(frozen=True)
class ExportHost:
    """What every kind shares: the node's QSDs and the per-volume directories under the state dir."""

    qsd: QSDShards
    exports_dir: Path
    pools: Mapping[str, Pool]
    failpoints: Failpoints = NO_FAILPOINTS
    # Asked before QSD opens a volume's chain from disk (`attach.TopImage.before_open`): refuses to open one
    # that reads through another node that does not answer, which would hold QSD's monitor.
    before_open: Callable[[VolumeRecord], Awaitable[None]] | None = None
    # The keys of the encrypted volumes staged here (`csi_qsd.sys.volume_keys`), for every open of their layers.
    keys: KeyStore = dataclasses.field(default_factory=lambda: KeyStore(None))

    def daemon_of(self, volume_id: str) -> QSDDaemon:
        """The QSD (shard) serving the volume."""
        return self.qsd.of(volume_id)

    def client_of(self, volume_id: str) -> QSDClient:
        return self.qsd.client_of(volume_id)

    def volume_dir(self, volume_id: str) -> Path:
        return self.exports_dir / volume_id

    def top_image(self, volume: VolumeRecord) -> attach.TopImage:
        """What QSD must have open as the volume's top node, in the terms of the volume's pool."""
        storage = self.pools[volume.pool].storage(volume.image)
        check = functools.partial(self.before_open, volume) if self.before_open is not None else None
        key = self.keys.get(volume.id) if volume.params.encrypted else None
        return attach.TopImage(volume.id, volume.generation, storage, volume.params, volume.qos, before_open=check,
                               key=key)


class ExportPath(abc.ABC):
    """One way of exporting a volume; idempotent steps, each safe to repeat after a crash."""

    kind: ClassVar[ExportKind]

    def __init__(self, host: ExportHost) -> None:
        self.host = host

    def check_access(self, volume: VolumeRecord, block: bool) -> None:
        """Refuse an access type this kind cannot serve. Raises InvalidArgument."""

    def fs_type(self, block: bool, requested: str) -> str:
        """The filesystem the stage records ('' when the kind makes none)."""
        return ""

    def export_broken(self, volume_id: str) -> bool:
        """True if the host side of the volume's export reports QSD gone (ENOTCONN and the like)."""
        return False

    @abc.abstractmethod
    async def bring_up(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], client: QSDClient,
    ) -> StageRecord:
        """Ensure the export and everything staged on it; return the stage as it now is."""

    @abc.abstractmethod
    async def tear_down(self, volume: VolumeRecord, stage: StageRecord, client: QSDClient, *, thorough: bool) -> None:
        """Undo staging in reverse; safe on a partly staged volume."""

    @abc.abstractmethod
    async def publish(
        self, volume: VolumeRecord, stage: StageRecord, record: PublishRecord, others: list[PublishRecord],
    ) -> PublishRecord:
        """Ensure `record`'s target carries the volume; return the record as it now is."""

    def check_publish(self, volume: VolumeRecord, stage: StageRecord, mount_group: str) -> None:
        """Refuse a publish for a pod of `mount_group` that could not use the volume. Raises FailedPrecondition."""

    async def check_unused(self, volume: VolumeRecord, stage: StageRecord | None) -> None:
        """Refuse to take the volume from a consumer that still has it open (before any intent is recorded).

        Raises FailedPrecondition while one has, Unavailable while that cannot be told.
        """

    @abc.abstractmethod
    async def unpublish(self, volume: VolumeRecord, stage: StageRecord | None, record: PublishRecord) -> None:
        """Take the volume away from `record`'s target; an unpublished target is fine."""

    @abc.abstractmethod
    async def condition(self, volume: VolumeRecord) -> tuple[bool, str]:
        """(abnormal, message) as NodeGetVolumeStats reports it."""

    @abc.abstractmethod
    async def stats(self, volume: VolumeRecord, stage: StageRecord, path: Path) -> VolumeStats:
        """Usage at a staging or target path. Raises NotFound."""

    async def check_expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        """Refuse a growth this kind cannot do now, before anything changes. Raises FailedPrecondition."""

    @abc.abstractmethod
    async def expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        """Grow the staged volume to `size` bytes (its image and whatever sits on it); idempotent.

        Called after `check_expand` let it through and the pool made room.
        """

    @contextlib.asynccontextmanager
    async def quiesced(self, volume: VolumeRecord, stage: StageRecord) -> AsyncIterator[None]:
        """Hold the consumer still while QSD switches the volume to a new top image."""
        yield

    async def release(self, volume: VolumeRecord, stage: StageRecord) -> None:
        """Let go of a hold (`quiesced`) that a crash may have left on; harmless when none is on."""

    def check_move(self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord]) -> None:
        """Refuse a move to a new home (`csi_qsd.node.moves`) this kind cannot do now. Raises FailedPrecondition."""

    async def move(
        self, volume: VolumeRecord, stage: StageRecord, old: attach.TopImage, new: attach.TopImage,
        commit: Callable[[], Awaitable[None]],
    ) -> None:
        """Copy the volume from `old` into `new` under its live export, switch the export to `new`, and `commit`.

        The default copies with backups while the volume is in use, then
        copies the rest and switches while `quiesced` holds the consumer
        still, and commits once QSD reads the new top. Raises Aborted if
        writes went on while held still; what a failure leaves, `csi_qsd.node.moves`
        undoes.
        """
        client = self.host.client_of(volume.id)
        await qsd_move.open_new_home(client, new)
        await qsd_move.copy_converging(client, old, new)
        async with self.quiesced(volume, stage):
            held = time.monotonic()
            self.host.failpoints.hit("move.held")
            await qsd_move.copy_rest(client, old, new)
            await qsd_move.switch(client, new)
            self.host.failpoints.hit("move.after_switch")
            await commit()
        log.info("event=move_switched volume_id=%s held_ms=%.0f", volume.id, (time.monotonic() - held) * 1000)

    async def finish_move(self, volume: VolumeRecord, stage: StageRecord, old: attach.TopImage,
                          new: attach.TopImage) -> None:
        """A committed move whose switch a crash cut off: make the export read `new` with nothing lost."""
        client = self.host.client_of(volume.id)
        async with self.quiesced(volume, stage):
            await qsd_move.copy_rest(client, old, new)
            await qsd_move.switch(client, new)


def refuse_block(volume: VolumeRecord, kind: str) -> None:
    raise InvalidArgument(f"volume {volume.id} is a {kind} volume: stage it with the mount access type")
