"""Make a volume copied from another node local, in the background, and say how it is doing.

A volume made from another node's snapshot (`csi_qsd.controller.copy_targets`)
reads through a local copy image whose backing file is the source node's
NBD export. Here QSD fills that image with block-stream, at the configured
rate: the volume's top image is opened in the QSD (shard) that serves or
will serve it, exactly as staging opens it, so a stage during the copy finds
it open and adds its exports; the job streams into the copy image below the
top, so the volume's own changed-block record sees only its user's writes.

When the job ends well, the copy image no longer names a backing file: it is
whole. Only then is the copy recorded as done and the source's lease given
back. Until then the volume works (reads fall through to the source), and a
source that stops answering makes reads of what is not yet copied fail
after QEMU's reconnect delay and the volume report abnormal; the copy is
retried (with back-off) until the source answers again, and resumes where
it was (block-stream skips what the copy image holds). A driver that starts
resumes every copy its catalog records; a job still running in a QSD that
outlived the driver is waited for, not restarted.

The source keeps a lease for --copy-lease-ttl after it was last asked for
(`csi_qsd.controller.copy_sources.CopySources`), so the copy asks again
(renews) when it starts or resumes and a few times per TTL while it streams.
A source that no longer holds the copy's snapshot (the lease expired while
this node was away, or an operator dropped it) makes the copy LOST: never
completed from another snapshot, its volume abnormal for good, naming the
source; deleting the volume is the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from pathlib import Path

from csi_qsd.catalog import Catalog, CopyRecord, CopyRole, CopyState, VolumeRecord
from csi_qsd.copy_terms import PEER_TLS_OBJECT, CopyLease, CopyPeers, CopySettings, point_backing
from csi_qsd.errors import Aborted, DriverError, NotFound, QSDError, SourceLost, Unavailable
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.node import placement
from csi_qsd.qcow2.backing import names_backing
from csi_qsd.qsd import attach, block_jobs, encryption, graph
from csi_qsd.qsd.client import QSDClient
from csi_qsd.sys import nbd_tcp
from csi_qsd.sys.locks import KeyedLocks

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
RETRY_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)
REACH_TIMEOUT = 3.0
RENEWALS_PER_TTL = 4  # the copy asks for its lease again this many times per --copy-lease-ttl while it streams


def _fingerprint(files: tuple[Path, ...]) -> bytes:
    """A digest of the node's TLS files. Raises OSError (FileNotFoundError naming the first one missing)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes() + b"\0")
    return digest.digest()


def job_id(volume_id: str) -> str:
    return "cqcopy-" + volume_id.removeprefix("vol-")


@dataclasses.dataclass(frozen=True)
class CopyStatus:
    """How a copy stands: bytes done of total, and what stops it (empty while it goes well)."""

    node: str
    done: int = 0
    total: int = 0
    problem: str = ""


class CopyFill:
    """The background fills of this node's copied volumes, one task each."""

    def __init__(
        self, catalog: Catalog, exports: ExportPaths, locks: KeyedLocks, peers: CopyPeers, settings: CopySettings,
    ) -> None:
        self._catalog = catalog
        self._exports = exports
        self._locks = locks
        self._peers = peers
        self._settings = settings
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._status: dict[str, CopyStatus] = {}
        self._lost: dict[str, CopyStatus] = {}  # copies whose source no longer holds their snapshot
        # What each QSD's TLS client object was read from (a digest of the files), so renewed files are loaded
        # before the next copy opens its link. Unknown after a driver restart: loaded again once.
        self._loaded: dict[QSDClient, bytes] = {}

    async def prepare(self, client: QSDClient, *, required: bool = False) -> None:
        """Give a (re)started QSD the TLS client credentials copies' backing files name, before any volume opens,
        and load them again where the node's files changed since (a renewed certificate), before a copy opens.

        QEMU reads the files once, at object-add: they are laid out for it in the runtime directory and
        removed as soon as QSD answered (`csi_qsd.sys.runtime`), so no key file stays behind.
        The files come from an optional Secret that may appear after the driver starts (deploy/node.yaml):
        while they are missing, a QSD start goes on without them (logged), and a copy that needs them
        (`required`) raises Unavailable naming the missing file.
        """
        if self._settings.tls is None:
            return
        cert, key, ca = self._settings.tls
        present = False
        try:
            files = await asyncio.to_thread(_fingerprint, (ca, cert, key))  # in the order QEMU reads them
            present = await attach.has_object(client, PEER_TLS_OBJECT)
            if present and self._loaded.get(client) == files:
                return
            async with nbd_tcp.credentials(self._settings.runtime_dir, cert, key, ca, endpoint="client") as directory:
                await attach.ensure_tls_client(client, PEER_TLS_OBJECT, directory, reload=present)
        except FileNotFoundError as error:
            if required:
                raise Unavailable(f"copies between nodes need this node's TLS files, missing: {error.filename}") \
                    from error
            log.warning("event=copy_tls_missing file=%s hint=copies from other nodes wait for the node's "
                        "metadata TLS Secret", error.filename)
            return
        except QSDError as error:
            if not present:
                raise
            # QEMU refused the renewed files: the credentials loaded before stay, and the next copy tries again.
            log.warning("event=copy_tls_reload_refused error=%r", str(error))
            return
        log.info("event=copy_tls_loaded reload=%s", present)
        self._loaded[client] = files

    def start(self, volume_id: str) -> None:
        """Run (or keep running) the copy of `volume_id`: fill, then give the lease back."""
        task = self._tasks.get(volume_id)
        if task is None or task.done():
            self._tasks[volume_id] = asyncio.create_task(self._run(volume_id), name=f"copy-{volume_id}")

    def lost(self, volume_id: str) -> bool:
        return volume_id in self._lost

    def status(self, volume_id: str) -> CopyStatus | None:
        """The copy's state while the volume is not yet local; None once it is (or never was a copy)."""
        if volume_id in self._lost:
            return self._lost[volume_id]
        task = self._tasks.get(volume_id)
        return self._status.get(volume_id) if task is not None and not task.done() else None

    async def stop(self, volume_id: str) -> bool:
        """Before an unstaged volume is deleted: end its fill (task and QSD job), close what the fill opened.

        False (nothing done) if the volume is no copy under way, or staged (its delete is refused).
        """
        if await self._catalog.copy(volume_id, CopyRole.TARGET) is None or await self._catalog.stage(volume_id):
            return False
        task = self._tasks.pop(volume_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._status.pop(volume_id, None)
        self._lost.pop(volume_id, None)
        for daemon in self._exports.host.qsd.daemons:
            if not daemon.ready:
                continue
            with contextlib.suppress(QSDError):
                await block_jobs.cancel_job(daemon.client, job_id(volume_id))
        async with self._locks.hold(volume_id):
            if await self._catalog.stage(volume_id) is None:
                for daemon in self._exports.host.qsd.daemons:
                    if daemon.ready:
                        with contextlib.suppress(QSDError):
                            await attach.remove_volume(daemon.client, volume_id)
            await self._forget_key_if_unstaged(volume_id)
        return True

    async def _forget_key_if_unstaged(self, volume_id: str) -> None:
        """An encrypted copy's key, held since CreateVolume for the fill, goes once the fill needs it no more, unless
        a stage holds it (its unstage then drops it). Under the volume's lock: unstage checks the copy row under it."""
        if await self._catalog.stage(volume_id) is None:
            await asyncio.to_thread(self._exports.host.keys.forget, volume_id)

    async def close(self) -> None:
        """Stop watching; jobs running in QSD go on, and the next driver picks them up."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, volume_id: str) -> None:
        attempt = 0
        while True:
            record = await self._catalog.copy(volume_id, CopyRole.TARGET)
            if record is None:
                return
            self._status.setdefault(volume_id, CopyStatus(record.node))
            if record.state is CopyState.LOST:
                self._lost[volume_id] = CopyStatus(record.node, problem=(
                    f"copy from node {record.node or '?'} lost: that node no longer serves snapshot "
                    f"{record.snapshot_id} to this copy (its lease expired or was dropped), so the data not yet "
                    "copied cannot be read; delete the volume and make it again"))
                return
            try:
                if record.state is CopyState.RELEASING:
                    await self._peers.release(record.node, volume_id)
                    async with self._locks.hold(volume_id):
                        await self._catalog.delete_copy(volume_id, CopyRole.TARGET)
                        await self._forget_key_if_unstaged(volume_id)
                    log.info("event=copy_released volume_id=%s node=%s", volume_id, record.node)
                    return
                volume = await self._catalog.volume(volume_id)
                if volume is None:  # deleted under us: give the lease back
                    await self._catalog.put_copy(dataclasses.replace(record, state=CopyState.RELEASING))
                    continue
                await self._fill(record, volume)
                await self._catalog.put_copy(dataclasses.replace(record, state=CopyState.RELEASING))
                log.info("event=copy_local volume_id=%s node=%s snapshot_id=%s", volume_id, record.node,
                         record.snapshot_id)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except SourceLost as exc:
                log.error("event=copy_lost volume_id=%s node=%s snapshot_id=%s error=%r", volume_id, record.node,
                          record.snapshot_id, str(exc))
                await self._catalog.put_copy(dataclasses.replace(record, state=CopyState.LOST))
            except (DriverError, OSError) as exc:
                delay = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]
                attempt += 1
                if not isinstance(exc, Aborted):
                    problem = (f"copy from node {record.node or '?'} interrupted: {exc}; data not yet copied cannot "
                               "be read until it resumes (retrying)")
                    self._status[volume_id] = dataclasses.replace(self._status[volume_id], problem=problem)
                    log.warning("event=copy_retry volume_id=%s node=%s delay=%.1f error=%r", volume_id, record.node,
                                delay, str(exc))
                await asyncio.sleep(delay)
            except Exception:
                log.exception("event=copy_failed volume_id=%s", volume_id)
                await asyncio.sleep(RETRY_SECONDS[-1])

    async def _fill(self, record: CopyRecord, volume: VolumeRecord) -> None:
        """Fill the copy image until it stands alone. Raises DriverError (retried), OSError."""
        local = Path(record.image)
        if not await asyncio.to_thread(names_backing, local):
            await self._close_if_unstaged(volume)
            return
        loop = asyncio.get_running_loop()
        if not await nbd_tcp.answers(record.address, REACH_TIMEOUT):
            record, lease = await self._relearn(record, volume)
            renew_at, ttl = _next_renewal(loop.time(), lease.ttl), lease.ttl
        else:  # a source whose listener is down (its driver restarting) still serves: stream, renew later
            renew_at, ttl = await self._renew_while_streaming(record, volume.id, loop.time(), 0.0)
        stage = await self._catalog.stage(volume.id)
        shard = stage.shard if stage is not None else await placement.shard_for(
            self._catalog, volume, self._exports.host.qsd.count)
        daemon = self._exports.host.qsd.daemons[shard]
        if not daemon.ready:
            raise Unavailable("qemu-storage-daemon is not ready")
        client = daemon.client
        job = job_id(volume.id)
        if await client.job(job) is None:
            async with self._locks.hold(volume.id):
                await self.prepare(client, required=True)
                current = await self._catalog.volume(volume.id)
                if current is None:
                    return
                await attach.ensure_top(client, self._exports.host.top_image(current))
                node = await attach.node_reading(client, local)
                if not node:
                    raise QSDError(f"qemu-storage-daemon has not opened the copy image {local}")
                await block_jobs.start_fill(client, job, node, self._settings.rate)
            log.info("event=copy_stream volume_id=%s node=%s rate=%d", volume.id, record.node, self._settings.rate)
        while True:
            info = await client.job(job)
            if info is None:
                raise QSDError(f"block job {job} is gone")
            self._status[volume.id] = CopyStatus(record.node, int(info.get("offset", 0)), int(info.get("len", 0)),
                                                 self._status.get(volume.id, CopyStatus("")).problem
                                                 if info.get("status") != "running" else "")
            if info["status"] in ("pending", "concluded"):
                break
            if loop.time() >= renew_at:
                renew_at, ttl = await self._renew_while_streaming(record, volume.id, loop.time(), ttl)
            await asyncio.sleep(POLL_SECONDS)
        await client.finish_job(job)  # finalizes (the copy image drops its backing) and dismisses; QSDError if failed
        await encryption.drop_link_layers(client, graph.nodes_for(volume.id).link)
        if await asyncio.to_thread(names_backing, local):
            raise QSDError(f"the copy image {local} still names its backing file after the stream")
        await self._close_if_unstaged(volume)

    async def _renew(self, record: CopyRecord, volume_id: str) -> CopyLease:
        """Ask the node that granted the copy's lease (`record.node`), and it alone, for the lease again (it lasts
        --copy-lease-ttl from now on).

        An answer from another node is refused (given back, never followed):
        the copy reads its data from the node it started from only.
        Raises SourceLost if the source no longer holds the copy's snapshot
        (a new lease of another snapshot, which the copy must not read, is
        given back at once), Unavailable if the source could not be asked
        or another node answered.
        """
        try:
            lease = await self._peers.lease(record.source, volume_id, record.node)
        except NotFound as exc:
            raise SourceLost(f"node {record.node} no longer holds {record.source.replace(':', ' ')} for copy "
                             f"{volume_id}: {exc}") from None
        if lease.node != record.node:
            with contextlib.suppress(DriverError):
                await self._peers.release(lease.node, volume_id)
            log.warning("event=copy_lease_answer_refused volume_id=%s node=%s answered=%s", volume_id, record.node,
                        lease.node)
            raise Unavailable(f"node {lease.node} answered for copy {volume_id}, whose lease node {record.node} "
                              "granted; only that node may serve it")
        if lease.snapshot_id != record.snapshot_id:
            with contextlib.suppress(DriverError):
                await self._peers.release(lease.node, volume_id)
            raise SourceLost(f"node {lease.node} serves {record.source.replace(':', ' ')} for copy {volume_id} as "
                             f"snapshot {lease.snapshot_id}, no longer {record.snapshot_id}: the lease was dropped")
        return lease

    async def _renew_while_streaming(self, record: CopyRecord, volume_id: str, now: float,
                                     ttl: float) -> tuple[float, float]:
        """Renew the lease (of `ttl` seconds as last heard, 0: not yet) during the fill; when to renew next, and
        the TTL. A source that cannot be asked now is asked again soon (the fill itself notices a source that is
        gone); raises SourceLost."""
        try:
            lease = await self._renew(record, volume_id)
        except SourceLost:
            raise
        except DriverError as exc:
            log.warning("event=copy_renew_failed volume_id=%s node=%s error=%r", volume_id, record.node, str(exc))
            soon = RETRY_SECONDS[-1] if ttl <= 0 else min(RETRY_SECONDS[-1], ttl / RENEWALS_PER_TTL)
            return now + soon, ttl
        return _next_renewal(now, lease.ttl), lease.ttl

    async def _relearn(self, record: CopyRecord, volume: VolumeRecord) -> tuple[CopyRecord, CopyLease]:
        """The source does not greet at the recorded address: ask the lease again, and follow it if it moved.

        A restarted source serves a lease whose port something else took on
        another port (`CopySources`). The copy image names the address in
        its header, so it can point at the new one only while no QSD has it
        open: the fill's own open is closed first; a staged volume keeps
        the old link until it is unstaged, which the volume's condition says.
        Raises Unavailable, SourceLost.
        """
        try:
            lease = await self._renew(record, volume.id)
        except SourceLost:
            raise
        except DriverError as exc:
            raise Unavailable(f"node {record.node} does not answer at {record.address}: {exc}") from None
        if lease.address == record.address:
            raise Unavailable(f"node {record.node} does not answer at {record.address}")
        local = Path(record.image)
        async with self._locks.hold(volume.id):
            if await self._catalog.stage(volume.id) is None:
                for daemon in self._exports.host.qsd.daemons:
                    if daemon.ready:
                        await attach.remove_volume(daemon.client, volume.id)
            for daemon in self._exports.host.qsd.daemons:
                if daemon.ready and await attach.node_reading(daemon.client, local):
                    raise Unavailable(
                        f"node {record.node} now serves this copy at {lease.address}, not {record.address}; volume "
                        f"{volume.id} is staged and reads through the old address until it is unstaged (then the "
                        "copy resumes)")
            key = self._exports.host.keys.get(volume.id) if volume.params.encrypted else None
            if volume.params.encrypted and key is None:
                raise Unavailable(f"node {record.node} now serves this copy at {lease.address}; volume {volume.id} is "
                                  "encrypted and this node holds no key for it: stage it (with its Secret) to go on")
            await point_backing(self._settings.qemu_img, local, lease.address, lease.export, record.node, key=key,
                                older=lease.older)
            moved = dataclasses.replace(record, address=lease.address)
            await self._catalog.put_copy(moved)
        log.warning("event=copy_source_moved volume_id=%s node=%s old=%s new=%s", volume.id, record.node,
                    record.address, lease.address)
        return moved, lease

    async def _close_if_unstaged(self, volume: VolumeRecord) -> None:
        """Close what the fill opened (closing flushes the copy image); a staged volume keeps its graph."""
        async with self._locks.hold(volume.id):
            if await self._catalog.stage(volume.id) is not None:
                return
            for daemon in self._exports.host.qsd.daemons:
                if daemon.ready:
                    await attach.remove_volume(daemon.client, volume.id)


def _next_renewal(now: float, ttl: float) -> float:
    return now + ttl / RENEWALS_PER_TTL if ttl > 0 else float("inf")
