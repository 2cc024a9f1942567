"""The source end of a copy: the read leases that serve this node's snapshots to copies on other nodes.

A lease is a row recorded before its NBD server starts
(`csi_qsd.sys.nbd_tcp`, detached: it outlives the driver, and a driver that
starts serves again every lease whose server is gone). A lease belongs to
the node that asked for it: only that node may ask it again or release it
(PERMISSION_DENIED naming both), and its NBD server lets in only the
certificate that node asked with (QEMU's `authz-simple` on that
certificate's exact subject, kept beside the pid file for the server's
restarts); the target checks in turn that the server's certificate names
the source node (`tls-hostname`). An encrypted snapshot is served as its
image files as they lie on disk (ciphertext, opened on the target with the
volume's key): the snapshot's on the lease's address, each older layer of its
chain by a server of its own (qemu-nbd serves one image), on ports kept
beside the pid files and started, stopped and moved with the first. While a lease reads a snapshot,
DeleteSnapshot of it (and DeleteVolume of a volume being cloned) is
FAILED_PRECONDITION naming the copy and its node. A clone of a volume leases
a hidden snapshot cut for it, deleted with the lease. A lease lasts
--copy-lease-ttl past the last time its copy asked for it (the copy renews
it while it fills), so a copy whose node is gone for good frees its source;
an operator may drop one at once (`csi-qsd volume drop-lease`), and that
copy's node may not have it again until it deletes the copy's volume or the
operator lifts the drop (`csi-qsd volume lift-lease`). Nothing here knows of
gRPC (`csi_qsd.csi.copy_service` answers the other nodes' calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from csi_qsd import validate
from csi_qsd.catalog import (
    Catalog,
    CopyRecord,
    CopyRole,
    CopyState,
    SnapshotRecord,
    VolumeState,
    now,
)
from csi_qsd.controller.copy_layers import OlderLayers
from csi_qsd.controller.copy_layers import port as address_port
from csi_qsd.controller.encrypted import image_encrypted
from csi_qsd.controller.snapshots import Snapshots
from csi_qsd.copy_terms import CopyLease, CopySettings, parse_source
from csi_qsd.errors import (
    Aborted,
    DriverError,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from csi_qsd.qcow2 import keyed
from csi_qsd.qcow2.imagemap import file_spec, qcow2_spec
from csi_qsd.sys import durable, nbd_tcp, runtime
from csi_qsd.sys.locks import KeyedLocks

log = logging.getLogger(__name__)

# The name of the hidden snapshot of a volume cut for a clone on another node: this prefix and the clone's ID.
CUT_PREFIX = "copy."
EXPIRY_CHECK_SECONDS = 60.0  # at most this long between looks for expired leases
DROP_WAIT_SECONDS = 10.0  # an operator's drop waits this long for a renewal (or a lease) under way


class CopySources:
    """The source end: serve snapshots to copies on other nodes, and refuse deletes while they read."""

    def __init__(self, catalog: Catalog, snapshots: Snapshots, settings: CopySettings, volume_locks: KeyedLocks,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._catalog = catalog
        self._snapshots = snapshots
        self._settings = settings
        self._volume_locks = volume_locks  # the volumes' own: a lease of a clone and DeleteVolume exclude each other
        self._locks = KeyedLocks("copy")
        # When each lease was last asked for (granted or renewed), by `clock`. In memory: a driver that starts
        # counts every lease it finds from then, so a restart never shortens one.
        self._clock = clock
        self._renewed: dict[str, float] = {}
        self._expiry: asyncio.Task[None] | None = None
        # One node's new leases are granted one at a time, so its count against the limit is exact.
        self._granting: dict[str, asyncio.Lock] = {}
        self._older = OlderLayers(settings.copies_dir, settings.qemu_nbd, lambda: self._settings.host)

    async def lease(self, copy_volume_id: str, node: str, source: str, subject: str = "") -> CopyLease:
        """Serve `source` for the copy `copy_volume_id` on `node` (idempotent), to the client certificate whose
        subject is `subject` ('' : `CN=<node>`, a plain node certificate). Raises NotFound,
        FailedPrecondition (no TLS files), ResourceExhausted (no free port, or `node` holds as many leases as
        one node may), PermissionDenied (the copy's lease belongs to another node)."""
        validate.volume_id(copy_volume_id, "copy volume_id")
        kind, ident = parse_source(source)
        if self._settings.tls is None:
            raise FailedPrecondition("this node serves no copies: it has no node-to-node TLS files "
                                     "(--metadata-cert, --metadata-key, --metadata-client-ca)")
        await self._refuse_others(copy_volume_id, node, "lease")  # at once, even while the owner renews it
        async with self._locks.hold(copy_volume_id):
            record = await self._catalog.copy(copy_volume_id, CopyRole.SOURCE)
            if record is None:
                async with self._granting.setdefault(node, asyncio.Lock()):
                    await self._refuse_beyond_limit(node)
                    record = await self._new_lease(copy_volume_id, node, source, kind, ident)
            elif record.node != node:
                raise _not_yours(copy_volume_id, record.node, node, "lease")
            elif record.state is CopyState.REVOKED:
                raise NotFound(f"the lease of copy {copy_volume_id} was dropped by this node's operator; that copy "
                               "cannot go on")
            try:
                record = await self._serve(record, await self._admitted(record, subject))
            except BaseException:
                await self._drop(record)
                raise
            snapshot = await self._catalog.snapshot(record.snapshot_id)
            if snapshot is None:  # deleted before the lease row was seen
                await self._drop(record)
                raise NotFound(f"snapshot {record.snapshot_id} does not exist")
            self._renewed[copy_volume_id] = self._clock()
            return CopyLease("", record.snapshot_id, record.address, copy_volume_id, snapshot.size,
                             self._settings.lease_ttl, await image_encrypted(Path(record.image)),
                             tuple(await self._older.addresses(copy_volume_id)))

    async def _refuse_beyond_limit(self, node: str) -> None:
        """ResourceExhausted if `node` already holds as many leases here as one node may (a renewal is never
        refused: it holds its lease already). Leases an operator dropped hold nothing and do not count."""
        limit = self._settings.lease_limit
        held = sorted(r.volume_id for r in await self._catalog.copies(CopyRole.SOURCE)
                      if r.node == node and r.state is not CopyState.REVOKED)
        if len(held) >= limit:
            ports = self._settings.ports
            raise ResourceExhausted(
                f"node {node} holds {len(held)} leases on this node, the most one node may hold "
                f"(--copy-leases-per-node {limit}, of the {len(ports)} copy ports {ports.start}-{ports.stop - 1}); "
                f"it gets another once one of its copies is done or its lease released or expired "
                f"(`csi-qsd volume leases` on this node lists them: {', '.join(held[:5])}"
                f"{', ...' if len(held) > 5 else ''})")

    async def _new_lease(self, copy_volume_id: str, node: str, source: str, kind: str, ident: str) -> CopyRecord:
        """Record a lease of a snapshot (or of a hidden cut of a volume) that still exists.

        The row goes in under the lock a delete of what it reads takes, and
        that delete looks for leases under it (`refuse_snapshot_delete`,
        `refuse_volume_delete`): one of the two calls answers first and the
        other sees it, or gets ABORTED while it runs.
        """
        if kind == "snapshot":
            async with self._snapshots.holding(ident):
                snapshot = await self._snapshots.get(ident)
                if snapshot is None:
                    raise NotFound(f"snapshot {ident} does not exist")
                return await self._record(copy_volume_id, node, source, snapshot)
        volume = await self._catalog.volume(ident)
        if volume is None or volume.state is not VolumeState.READY:
            raise NotFound(f"volume {ident} does not exist")
        await self._free_port(copy_volume_id)  # none free: refused before the volume is cut
        # Idempotent by name: a retry of the same copy (the target reuses its ID) reads the same cut, so the
        # volume gains no new layer and no new top per retry.
        snapshot = await self._snapshots.cut_hidden(f"{CUT_PREFIX}{copy_volume_id}", ident)
        try:
            async with self._volume_locks.hold(ident):
                volume = await self._catalog.volume(ident)
                if volume is not None and volume.state is VolumeState.READY:
                    return await self._record(copy_volume_id, node, source, snapshot)
            raise NotFound(f"volume {ident} does not exist")
        except BaseException:  # no lease (no port, a catalog error, the caller gone): the cut made for it goes
            await self._forget_cut(copy_volume_id, snapshot.id)
            raise

    async def _forget_cut(self, copy_volume_id: str, snapshot_id: str) -> None:
        """Delete the hidden cut of a lease that was not granted (its row too, if it went in after all).

        The volume now stands on the cut, so it stays, hidden, as any layer of its chain does: a retry of the
        copy reuses it, and a flatten or the volume's delete reclaims it.
        """
        try:
            record = await self._catalog.copy(copy_volume_id, CopyRole.SOURCE)
            if record is not None:
                await self._drop(record)
            else:
                await self._snapshots.delete(snapshot_id)
        except DriverError as exc:  # the next start deletes it (`reconcile`)
            log.warning("event=copy_cut_kept copy_volume_id=%s snapshot_id=%s error=%r", copy_volume_id,
                        snapshot_id, str(exc))

    async def _free_port(self, copy_volume_id: str) -> int:
        """A port of --copy-ports that no other lease records and nothing listens on. Raises ResourceExhausted."""
        taken = set[int]()
        for r in await self._catalog.copies(CopyRole.SOURCE):
            if r.volume_id != copy_volume_id and r.address:
                taken.update(address_port(a) for a in [r.address, *await self._older.addresses(r.volume_id)])
        port = await asyncio.to_thread(nbd_tcp.pick_port, self._settings.host, self._settings.ports, taken)
        if port is None:
            raise ResourceExhausted(f"every copy port of this node ({self._settings.ports.start}-"
                                    f"{self._settings.ports.stop - 1}) is in use")
        return port

    async def _record(self, copy_volume_id: str, node: str, source: str, snapshot: SnapshotRecord) -> CopyRecord:
        port = await self._free_port(copy_volume_id)
        record = CopyRecord(
            volume_id=copy_volume_id, role=CopyRole.SOURCE, node=node, source=source,
            state=CopyState.SERVING, created_at=now(), snapshot_id=snapshot.id,
            address=f"{self._settings.host}:{port}", image=str(snapshot.image))
        await self._catalog.put_copy(record)
        log.info("event=copy_lease copy_volume_id=%s node=%s snapshot_id=%s address=%s",
                 copy_volume_id, node, snapshot.id, record.address)
        return record

    async def release(self, copy_volume_id: str, node: str = "") -> None:
        """Stop serving the copy and drop its lease; nothing if there is none.

        `node`: the node asking, which must be the one the lease is for ('': this node's operator, anyone's).
        Raises PermissionDenied.
        """
        if node:
            await self._refuse_others(copy_volume_id, node, "release")
        async with self._locks.hold(copy_volume_id):
            record = await self._catalog.copy(copy_volume_id, CopyRole.SOURCE)
            if record is not None and node and record.node != node:
                raise _not_yours(copy_volume_id, record.node, node, "release")
            if record is not None:
                await self._drop(record)
                log.info("event=copy_lease_released copy_volume_id=%s node=%s snapshot_id=%s",
                         copy_volume_id, record.node, record.snapshot_id)

    async def _refuse_others(self, copy_volume_id: str, node: str, action: str) -> None:
        """PermissionDenied if the copy's lease is another node's (asked again under the lock: a row may go)."""
        record = await self._catalog.copy(copy_volume_id, CopyRole.SOURCE)
        if record is not None and record.node != node:
            raise _not_yours(copy_volume_id, record.node, node, action)

    async def drop(self, copy_volume_id: str) -> CopyRecord:
        """An operator's drop of a lease (its copy's node gone for good): served no more, its snapshot freed.

        The copy, if it still runs, loses what it has not copied. Raises NotFound.
        """
        async with self._locks.wait_hold(copy_volume_id, DROP_WAIT_SECONDS) as held:
            if not held:  # a renewal that never ends
                raise Aborted(f"the lease of copy {copy_volume_id} stayed busy for {DROP_WAIT_SECONDS:g} s; retry")
            record = await self._catalog.copy(copy_volume_id, CopyRole.SOURCE)
            if record is None or record.state is CopyState.REVOKED:
                raise NotFound(f"this node serves no lease for copy {copy_volume_id}")
            await self._drop(record)
            # Remembered, holding nothing, so the copy's node (if it is still there) cannot have it again.
            await self._catalog.put_copy(dataclasses.replace(
                record, state=CopyState.REVOKED, snapshot_id="", address="", image="", created_at=now()))
            self._renewed[copy_volume_id] = self._clock()
        log.warning("event=copy_lease_dropped copy_volume_id=%s node=%s snapshot_id=%s reason=operator",
                    copy_volume_id, record.node, record.snapshot_id)
        return record

    async def lift(self, copy_volume_id: str) -> CopyRecord:
        """An operator's lift of a drop (`drop`): the copy's node may lease that copy again (it starts over, from
        whatever the source is then). Raises NotFound if the copy's lease was not dropped, Aborted while busy."""
        async with self._locks.wait_hold(copy_volume_id, DROP_WAIT_SECONDS) as held:
            if not held:
                raise Aborted(f"the lease of copy {copy_volume_id} stayed busy for {DROP_WAIT_SECONDS:g} s; retry")
            record = await self._catalog.copy(copy_volume_id, CopyRole.SOURCE)
            if record is None or record.state is not CopyState.REVOKED:
                raise NotFound(f"this node has dropped no lease of copy {copy_volume_id}")
            await self._drop(record)
        log.warning("event=copy_lease_drop_lifted copy_volume_id=%s node=%s", copy_volume_id, record.node)
        return record

    async def leases(self) -> list[tuple[CopyRecord, float]]:
        """Every lease this node serves, with the seconds since its copy last asked for it."""
        now = self._clock()
        return [(r, now - self._renewed.get(r.volume_id, now)) for r in await self._catalog.copies(CopyRole.SOURCE)]

    async def expire(self) -> list[str]:
        """Drop the leases not asked for within --copy-lease-ttl (their copies' nodes gone); their copy IDs.

        A drop (`drop`) never expires: it is kept until the copy's node releases the copy (its volume
        deleted) or an operator lifts it (`lift`), so the copy's node cannot have that copy again by waiting.
        """
        ttl, dropped = self._settings.lease_ttl, list[str]()
        if ttl <= 0:
            return dropped
        for record, age in await self.leases():
            if age <= ttl or record.state is CopyState.REVOKED or self._locks.busy(record.volume_id):
                continue
            async with self._locks.hold(record.volume_id):
                current = await self._catalog.copy(record.volume_id, CopyRole.SOURCE)
                if (current is None or current.state is CopyState.REVOKED
                        or self._clock() - self._renewed.get(record.volume_id, self._clock()) <= ttl):
                    continue
                await self._drop(current)
            log.warning("event=copy_lease_expired copy_volume_id=%s node=%s snapshot_id=%s idle_seconds=%.0f",
                        record.volume_id, record.node, record.snapshot_id, age)
            dropped.append(record.volume_id)
        return dropped

    def start_expiry(self) -> None:
        """Look for expired leases in the background, a few times per --copy-lease-ttl (at most every minute)."""
        if self._settings.lease_ttl > 0 and self._expiry is None:
            self._expiry = asyncio.create_task(self._expire_forever(), name="copy-lease-expiry")

    async def _expire_forever(self) -> None:
        interval = min(EXPIRY_CHECK_SECONDS, self._settings.lease_ttl / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire()
            except DriverError as exc:
                log.warning("event=copy_lease_expiry_failed error=%r", str(exc))
            except Exception:  # an eternal task must not end silently
                log.exception("event=copy_lease_expiry_failed")

    def _subject_file(self, copy_volume_id: str) -> Path:
        return self._settings.copies_dir / f"{copy_volume_id}.subject"

    async def _admitted(self, record: CopyRecord, subject: str = "") -> str:
        """The exact certificate subject the lease's server lets in: `subject` (what the lease's node presented
        now), kept for the server's restarts; else the one kept; else `CN=<node>`."""
        path = self._subject_file(record.volume_id)
        try:
            kept = await asyncio.to_thread(path.read_text)
        except FileNotFoundError:
            kept = ""
        if subject and subject != kept:
            data = subject.encode()
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(durable.create, path, lambda fd: os.write(fd, data))
        return subject or kept or nbd_tcp.plain_subject(record.node)

    async def _drop(self, record: CopyRecord) -> None:
        self._renewed.pop(record.volume_id, None)
        await asyncio.to_thread(self._subject_file(record.volume_id).unlink, missing_ok=True)
        if record.state is CopyState.REVOKED:  # serves and holds nothing
            await self._catalog.delete_copy(record.volume_id, CopyRole.SOURCE)
            return
        await self._stop(record)
        await self._catalog.delete_copy(record.volume_id, CopyRole.SOURCE)
        if parse_source(record.source)[0] == "volume":
            await self._snapshots.delete(record.snapshot_id)  # the hidden cut made for this clone

    async def refuse_snapshot_delete(self, snapshot_id: str) -> None:
        """FailedPrecondition while a copy on another node reads the snapshot (asked under the snapshot's lock)."""
        for record in await self._catalog.copies(CopyRole.SOURCE):
            if record.snapshot_id == snapshot_id:
                raise FailedPrecondition(
                    f"snapshot {snapshot_id} is being copied to volume {record.volume_id} on node {record.node}; "
                    "delete it once that copy is done (or that volume is deleted)")

    async def refuse_volume_delete(self, volume_id: str) -> None:
        """FailedPrecondition while a clone on another node reads the volume (asked under the volume's lock)."""
        for record in await self._catalog.copies(CopyRole.SOURCE):
            if record.source == f"volume:{volume_id}" and record.state is not CopyState.REVOKED:
                raise FailedPrecondition(
                    f"volume {volume_id} is being cloned to volume {record.volume_id} on node {record.node}; "
                    "delete it once that copy is done (or that volume is deleted)")

    async def reconcile(self) -> None:
        """Serve again every lease whose server is gone; drop leases whose snapshot is gone.

        Also removes the copies of the node's TLS files, private key included, that earlier versions kept in
        the state directory (`copies/tls-*`): nothing reads them, and the servers that did have them loaded.
        """
        for path in await asyncio.to_thread(sorted, self._settings.copies_dir.glob(runtime.SCRATCH_PREFIX + "*")):
            await asyncio.to_thread(runtime.remove, path)
            log.info("event=copy_tls_copy_removed path=%s", path)
        for record in await self._catalog.copies(CopyRole.SOURCE):
            self._renewed.setdefault(record.volume_id, self._clock())
            if record.state is CopyState.REVOKED:
                continue
            if await self._catalog.snapshot(record.snapshot_id) is None:
                log.warning("event=copy_lease_dropped copy_volume_id=%s reason=snapshot_gone", record.volume_id)
                await self._stop(record)
                await asyncio.to_thread(self._subject_file(record.volume_id).unlink, missing_ok=True)
                await self._catalog.delete_copy(record.volume_id, CopyRole.SOURCE)
                continue
            try:
                await self._serve(record, await self._admitted(record))
            except DriverError as exc:
                log.error("event=copy_serve_failed copy_volume_id=%s error=%r", record.volume_id, str(exc))

    async def close(self) -> None:
        """Stop looking for expired leases; the servers are the data plane and outlive the driver."""
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
            self._expiry = None

    def _pid_file(self, copy_volume_id: str) -> Path:
        return self._settings.copies_dir / f"{copy_volume_id}.pid"

    async def _stop(self, record: CopyRecord) -> None:
        """Stop every server of a lease: its snapshot's and its older layers'."""
        await nbd_tcp.stop(self._pid_file(record.volume_id), self._port(record))
        await self._older.stop(record.volume_id)

    @staticmethod
    def _port(record: CopyRecord) -> int:
        return address_port(record.address)

    async def _serve(self, record: CopyRecord, subject: str) -> CopyRecord:
        """Serve the lease to the certificate `subject` if its server is gone (or started before the node's TLS
        files last changed, or lets in another subject, or matches one by a glob as earlier versions did); the
        record, with a new address if the old one is lost.

        Called at every Lease, so a renewed certificate reaches a running
        server the next time its copy renews the lease (a few times per
        --copy-lease-ttl). A restarted node may find its lease's port taken by something else
        (or --copy-address changed): the lease then moves to a free port of
        --copy-ports, recorded, and the copy's node learns it when it asks
        the lease again (`csi_qsd.node.copy_fill`). Raises ResourceExhausted, HostCommandError.
        """
        pid_file = self._pid_file(record.volume_id)
        pid = nbd_tcp.serving_pid(pid_file, self._port(record))
        assert self._settings.tls is not None
        cert, key, ca = self._settings.tls
        specs = await _served(record)
        reason = "" if pid is None else (
            "authz" if not nbd_tcp.admits_only(pid, subject)  # another subject, or an earlier version's glob
            else "certificate" if nbd_tcp.started_before(pid, (cert, key, ca))
            else "" if await self._older.serving(record.volume_id, len(specs) - 1) else "older_layer")
        if pid is not None and not reason:
            return record
        async with contextlib.AsyncExitStack() as stack:
            try:  # QEMU's copy of the files lives only until the server has read them (`csi_qsd.sys.runtime`)
                tls = await stack.enter_async_context(
                    nbd_tcp.credentials(self._settings.runtime_dir, cert, key, ca, endpoint="server"))
            except OSError as exc:
                if pid is None:
                    raise
                log.warning("event=copy_tls_unreadable copy_volume_id=%s error=%r", record.volume_id, str(exc))
                return record  # serving with what it read at its start
            if pid is not None:  # the copy's NBD client reconnects to the same port (QEMU's reconnect-delay)
                log.warning("event=copy_server_restarted copy_volume_id=%s node=%s reason=%s", record.volume_id,
                            record.node, reason)
            before = [address_port(a) for a in await self._older.addresses(record.volume_id)]
            await self._stop(record)
            placed = await self._placed(record, before if len(before) in (0, len(specs) - 1) else None)
            pid = await nbd_tcp.start(
                self._settings.qemu_nbd, specs[0], host=self._settings.host,
                port=self._port(placed), export=record.volume_id, tls=tls, pid_file=pid_file, admit=subject)
            record, moved = placed, placed.address != record.address
            await self._older.serve(record.volume_id, specs[1:], tls=tls, admit=subject,
                                    ports=[] if moved else before, free_port=lambda: self._free_port(record.volume_id))
        log.info("event=copy_serving copy_volume_id=%s snapshot_id=%s address=%s pid=%d",
                 record.volume_id, record.snapshot_id, record.address, pid)
        return record

    async def _placed(self, record: CopyRecord, older: list[int] | None) -> CopyRecord:
        """The lease at its recorded address if that (and each of its `older` layers' ports) is still free here,
        else moved to a free port, recorded: the copy's node learns it when it asks the lease again, and the
        older layers' new ports with it (None: they are to be served anew, so the lease moves too)."""
        host = record.address.rpartition(":")[0]
        free = [await asyncio.to_thread(nbd_tcp.port_free, host, p) for p in [self._port(record), *(older or [])]]
        if host == self._settings.host and older is not None and all(free):
            return record
        moved = dataclasses.replace(record, address=f"{self._settings.host}:{await self._free_port(record.volume_id)}")
        log.warning("event=copy_lease_moved copy_volume_id=%s node=%s old=%s new=%s reason=%s",
                    record.volume_id, record.node, record.address, moved.address,
                    "address_changed" if host != self._settings.host else "port_taken")
        await self._catalog.put_copy(moved)
        return moved


async def _served(record: CopyRecord) -> list[str]:
    """What qemu-nbd serves of a lease's snapshot image: its data; or an encrypted one's file as it lies on disk
    (ciphertext: the copy's node opens it with the volume's key), then each older layer's file, next older first.

    Raises FailedPrecondition for an encrypted chain that is not all on this node, OSError.
    """
    image = Path(record.image)
    if not await image_encrypted(image):
        return [qcow2_spec(image, read_only=True)]
    return [file_spec(layer) for layer in [image, *await asyncio.to_thread(keyed.chain_below, image)]]


def _not_yours(copy_volume_id: str, owner: str, node: str, action: str) -> PermissionDenied:
    return PermissionDenied(f"copy {copy_volume_id} is leased to node {owner}; node {node} may not {action} it")


