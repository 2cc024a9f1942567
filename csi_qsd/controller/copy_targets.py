"""The target end of a copy: volumes made from a snapshot or volume that another node holds.

CreateVolume names a snapshot or volume this node does not hold. A peer
that holds it grants a read lease (`csi_qsd.controller.copy_sources`, on
that node): it serves the snapshot read-only over NBD with TLS. The new
volume is at once a thin overlay on a local copy image whose backing file is
that NBD export, so it can be staged and used before a byte has moved;
`csi_qsd.node.copy_fill` then fills the copy image (QSD's block-stream),
after which the copy image stands alone, the link is dropped and the lease
released. An encrypted source is served as its image file (ciphertext): the copy
image is then an encrypted qcow2 of its own over that file, opened with the
volume's key, which is checked over the link first and held (as a staged
volume's, `csi_qsd.sys.volume_keys`) until the copy is done.
The copy row is recorded before the lease is asked for, so a crash
at any point leaves a row that `reconcile` finishes (the fill resumes) or
undoes (the lease goes). The node-to-node calls are behind `CopyPeers`
(`csi_qsd.copy_terms`, which `csi_qsd.transport.copy_peers` implements);
nothing here knows of gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from csi_qsd import validate
from csi_qsd.catalog import (
    Catalog,
    CopyRecord,
    CopyRole,
    CopyState,
    SnapshotRecord,
    SnapshotState,
    VolumeRecord,
    VolumeState,
    now,
)
from csi_qsd.copy_terms import CopyLease, CopyPeers, CopySettings, lease_opens_with, nbd_backing, parse_source
from csi_qsd.errors import (
    AlreadyExists,
    DriverError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    SourceUnreachable,
    Unavailable,
)
from csi_qsd.params import (
    PROVISIONER_SECRET,
    SECRET_KEY,
    Capability,
    ImageFormat,
    QoS,
    VolumeParameters,
    choose_size,
    unsupported_capability,
)
from csi_qsd.pools.base import Pool
from csi_qsd.qcow2 import backing, blank, layer_bitmaps
from csi_qsd.sys import durable, nbd_tcp
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.sys.volume_keys import KeyStore, VolumeKey

log = logging.getLogger(__name__)

# How long a source has to greet before QSD may open a chain that reads through it (`CopyLinkCheck`): well
# below `csi_qsd.copy_terms.OPEN_TIMEOUT_SECONDS`, which bounds the open itself.
PROBE_SECONDS = 1.0
COPY_SUFFIX = "-copy.qcow2"
RETRY_IDS_MAX = 1024  # failed creates whose copy ID a retry reuses


def copy_image(pool: Pool, volume_id: str) -> Path:
    """The local copy image of a volume made from another node's snapshot."""
    return pool.image_path(volume_id, ImageFormat.QCOW2).with_name(f"{volume_id}{COPY_SUFFIX}")


class CopyLinkCheck:
    """Refuse to let QSD open a chain that reads through another node that does not greet.

    QSD opens a copy image's NBD link with its monitor silent until the
    source answers or open-timeout passes, and a monitor silent for the QMP
    timeout gets the whole QSD (every volume of the node) killed. So before
    QSD opens any volume's chain from disk (stage, the rebuild after a QSD
    restart, a resize, the fill), the links the chain's headers name are
    asked for the NBD greeting first; one that does not greet within
    PROBE_SECONDS is UNAVAILABLE, naming the source node, and QSD is never
    asked. Costs nothing while no copy is under way.
    """

    def __init__(self, catalog: Catalog, timeout: float = PROBE_SECONDS) -> None:
        self._catalog = catalog
        self._timeout = timeout

    async def __call__(self, volume: VolumeRecord) -> None:
        """Raises SourceUnreachable (UNAVAILABLE) if the volume's chain reads through a link that does not answer."""
        copies = [r for r in await self._catalog.copies(CopyRole.TARGET) if r.state is not CopyState.RELEASING]
        if not copies or Path(volume.image).suffix != ".qcow2":
            return
        for address in await asyncio.to_thread(backing.nbd_links, Path(volume.image)):
            if await nbd_tcp.answers(address, self._timeout):
                continue
            nodes = sorted({r.node for r in copies if r.address == address and r.node})
            source = f"node {', '.join(nodes)}" if nodes else "another node"
            raise SourceUnreachable(
                f"volume {volume.id} reads data not yet copied from {source}, whose copy server at {address} "
                f"does not answer; it can be opened once {source} serves it again (the copy retries and learns a "
                "new address by itself)", node=", ".join(nodes), address=address)


class CopyTargets:
    """The target end: volumes made from a snapshot or volume that another node holds."""

    def __init__(
        self, catalog: Catalog, pool: Pool, peers: CopyPeers, settings: CopySettings, name_locks: KeyedLocks,
        on_copy: Callable[[str], None] = lambda volume_id: None, keys: KeyStore | None = None,
    ) -> None:
        self._catalog = catalog
        # An encrypted copy's key, held as a staged volume's is (`csi_qsd.sys.volume_keys`) while its fill may
        # have to open the volume; `csi_qsd.node.copy_fill` forgets it once the copy is done and it is unstaged.
        self._keys = keys if keys is not None else KeyStore(None)
        self._pool = pool
        self._peers = peers
        self._settings = settings
        self._name_locks = name_locks  # `Volumes.name_locks`: a name is locked alike wherever its volume comes from
        self.on_copy = on_copy  # told of every copy to (re)start or to release: `csi_qsd.node.copy_fill`
        # The ID a failed create used, per (name, source): its retry asks the source for the same copy, so a
        # clone's source cuts its volume once, not once per retry. In memory: a restart costs one more cut.
        self._retry_ids: dict[tuple[str, str], str] = {}

    async def create(
        self, name: str, required: int, limit: int, params: VolumeParameters, caps: list[Capability],
        *, source: str, qos: QoS = QoS(), key: VolumeKey | None = None, key_version: str = "",
    ) -> VolumeRecord:
        """A new volume over another node's snapshot (or a hidden cut of its volume), usable at once.

        An encrypted one (`key`, the volume's passphrase) reads the source's image files, ciphertext, and
        opens them with `key`. Raises InvalidArgument, NotFound (no node holds the source),
        Unavailable (a peer could not be asked), OutOfRange, AlreadyExists, PermissionDenied (`key` does
        not open the source), FailedPrecondition.
        """
        parse_source(source)
        for cap in caps:
            reason = unsupported_capability(cap, params)
            if reason:
                raise InvalidArgument(reason)
        if params.format is not ImageFormat.QCOW2:
            raise InvalidArgument("volumes made from a snapshot or another volume must use format 'qcow2'")
        if params.pool != self._pool.id:
            raise InvalidArgument(f"a volume copied from another node goes to the file pool {self._pool.id!r}, "
                                  f"not {params.pool!r}")
        if self._settings.tls is None:
            raise NotFound(f"{source.replace(':', ' ')} is not on this node, and this node reaches no other "
                           "(no node-to-node TLS files)")
        async with self._name_locks.hold(name):
            existing = await self._catalog.volume_by_name(name)
            if existing is not None and existing.state is VolumeState.READY:
                if existing.source != source or existing.params != params or existing.qos != qos or not (
                        existing.capacity >= required and (not limit or existing.capacity <= limit)):
                    raise AlreadyExists(f"volume named {name!r} exists ({existing.id}, {existing.capacity} bytes) "
                                        "with other parameters, source or capacity")
                return existing
            if existing is not None:
                raise FailedPrecondition(f"volume named {name!r} ({existing.id}) is being created or deleted; "
                                         "retry later")
            volume_id = self._retry_ids.pop((name, source), "") or validate.new_volume_id()
            intent = CopyRecord(volume_id=volume_id, role=CopyRole.TARGET, node="", source=source,
                                state=CopyState.LEASING, created_at=now())
            await self._catalog.put_copy(intent)
            try:
                return await self._create(volume_id, intent, name, required, limit, params, qos, key, key_version)
            except BaseException:
                await self._undo(intent)
                self._remember_for_retry(name, source, volume_id)
                raise

    def _remember_for_retry(self, name: str, source: str, volume_id: str) -> None:
        while len(self._retry_ids) >= RETRY_IDS_MAX:
            del self._retry_ids[next(iter(self._retry_ids))]  # the oldest
        self._retry_ids[(name, source)] = volume_id

    async def _create(
        self, volume_id: str, intent: CopyRecord, name: str, required: int, limit: int, params: VolumeParameters,
        qos: QoS, key: VolumeKey | None, key_version: str,
    ) -> VolumeRecord:
        lease = await self._peers.lease(intent.source, volume_id)
        intent = dataclasses.replace(intent, node=lease.node, snapshot_id=lease.snapshot_id, address=lease.address)
        await self._catalog.put_copy(intent)
        size = choose_size(required or lease.size, limit)
        if size < lease.size:
            raise OutOfRange(f"volume {name!r} must hold at least the {lease.size} bytes of its source")
        local = copy_image(self._pool, volume_id)
        top = self._pool.image_path(volume_id, ImageFormat.QCOW2)
        if key is not None:
            await self._make_encrypted(lease, intent.source, params, key, local)
            await asyncio.to_thread(self._keys.put, volume_id, key)
        else:
            self._refuse_encrypted(lease, intent.source, params)
            pieces = blank.image_bytes(lease.size, params.granularity, layer_bitmaps.OWN,
                                       backing=nbd_backing(lease.address, lease.export, lease.node),
                                       backing_format="raw")
            await asyncio.to_thread(durable.create, local, lambda fd: blank.write(fd, pieces))
        await self._pool.create_overlay(top, local, size, params.granularity, key=key)
        created = now()
        volume = VolumeRecord(
            id=volume_id, name=name, capacity=size, params=params, image=top, state=VolumeState.READY,
            pool=self._pool.id, created_at=created, backing=str(local), source=intent.source, qos=qos,
            key_version=key_version)
        snapshot = SnapshotRecord(
            id=validate.new_snapshot_id(), name=f"copy.{volume_id}", source_volume_id=volume_id, image=local,
            backing="", size=lease.size, created_at=created, state=SnapshotState.READY, hidden=True)
        copy = dataclasses.replace(intent, state=CopyState.STREAMING, image=str(local))
        await self._catalog.add_copy_volume(volume, snapshot, copy)
        log.info("event=volume_created volume_id=%s name=%s bytes=%d copy_from=%s node=%s", volume_id, name, size,
                 intent.source, lease.node)
        self.on_copy(volume_id)
        return volume

    @staticmethod
    def _refuse_encrypted(lease: CopyLease, source: str, params: VolumeParameters) -> None:
        """InvalidArgument if the source and the new volume are not encrypted alike."""
        if lease.encrypted != params.encrypted:
            raise InvalidArgument(
                f"{source.replace(':', ' ')} on node {lease.node} is {'' if lease.encrypted else 'not '}encrypted and "
                f"the new volume's StorageClass says encrypted={str(params.encrypted).lower()}: a volume and its "
                "source are encrypted alike")

    async def _make_encrypted(self, lease: CopyLease, source: str, params: VolumeParameters, key: VolumeKey,
                              local: Path) -> None:
        """An encrypted copy image over the source's image file, once `key` is seen to open that file.

        Raises InvalidArgument, PermissionDenied, Unavailable, OSError.
        """
        self._refuse_encrypted(lease, source, params)
        assert self._settings.tls is not None  # `create` refuses a node without
        cert, tls_key, ca = self._settings.tls
        if not await nbd_tcp.answers(lease.address, PROBE_SECONDS * 5):
            raise Unavailable(f"node {lease.node} serves {source.replace(':', ' ')} at {lease.address}, which does "
                              "not answer; retry once it does")
        async with nbd_tcp.credentials(self._settings.runtime_dir, cert, tls_key, ca, endpoint="client") as tls:
            opens = await lease_opens_with(self._settings.qemu_img, lease, tls, key)
        if not opens:
            raise PermissionDenied(
                f"the passphrase in entry {SECRET_KEY!r} of the Secret named by {PROVISIONER_SECRET!r} does not open "
                f"{source.replace(':', ' ')} on node {lease.node}: an encrypted copy takes its source's Secret")
        await self._pool.create_encrypted_copy(
            local, lease.size, params.granularity, key,
            nbd_backing(lease.address, lease.export, lease.node, encrypted=True, older=lease.older))

    async def _undo(self, intent: CopyRecord) -> None:
        """A create that failed or crashed: its images, its key, its lease and its row go."""
        if await self._catalog.volume(intent.volume_id) is None:
            await asyncio.to_thread(self._keys.forget, intent.volume_id)
            for image in (self._pool.image_path(intent.volume_id, ImageFormat.QCOW2),
                          copy_image(self._pool, intent.volume_id)):
                if image.exists():
                    await asyncio.to_thread(durable.unlink, image)
        try:
            await self._peers.release(intent.node, intent.volume_id)
        except DriverError as exc:  # kept: the next start asks again
            log.warning("event=copy_release_deferred volume_id=%s error=%r", intent.volume_id, str(exc))
            return
        await self._catalog.delete_copy(intent.volume_id, CopyRole.TARGET)

    async def reconcile(self) -> None:
        """Undo creates a crash cut off; list the copies to resume."""
        for record in await self._catalog.copies(CopyRole.TARGET):
            if record.state is CopyState.LEASING:
                log.info("event=reconcile_undo_copy volume_id=%s", record.volume_id)
                await self._undo(record)
            else:
                self.on_copy(record.volume_id)

    async def release_later(self, volume_id: str) -> None:
        """After the volume is deleted: its copy, if any, gives its lease back (now or at a later retry)."""
        record = await self._catalog.copy(volume_id, CopyRole.TARGET)
        if record is not None:
            await self._catalog.put_copy(dataclasses.replace(record, state=CopyState.RELEASING))
            self.on_copy(volume_id)
