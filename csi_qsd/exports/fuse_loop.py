"""Containers: QSD FUSE export → loop device → a filesystem (mounted, bind-mounted) or the raw device.

The loop device is direct-I/O where QSD's FUSE export keeps parallel writes
intact and buffered elsewhere (`csi_qsd.qsd.features`, decided by the daemon);
a volume keeps the mode it was staged with until its next stage. When QSD
dies, its FUSE file answers ENOTCONN and every loop device and mount on it is
dead: `bring_up` notices a fresh export and lazily drops them first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

from csi_qsd.catalog import AccessType, PublishRecord, StageRecord, VolumeRecord
from csi_qsd.errors import FailedPrecondition, NotFound, StillInUse
from csi_qsd.exports.base import ExportPath, VolumeStats
from csi_qsd.params import ExportKind
from csi_qsd.publish import block, filesystem
from csi_qsd.qsd import attach, export_nodes, graph
from csi_qsd.qsd.client import QSDClient
from csi_qsd.sys import caps, filesystems, fusectl, loop, mounts

log = logging.getLogger(__name__)

# How long unstaging waits for a filesystem another mount namespace still holds (a pod's, ending), or for a
# process still holding the loop device, before answering UNAVAILABLE; kubelet retries.
FILESYSTEM_RELEASE_SECONDS = 10.0


def export_file(exports_dir: Path, volume_id: str) -> Path:
    """The regular file QSD's FUSE export of a volume is mounted on."""
    return exports_dir / volume_id / "disk"


class FuseLoopExport(ExportPath):
    """Container volumes: QSD's FUSE export of the image, a loop device over it, then a filesystem or the device.

    A container needs a block device or a mount; QSD offers neither, but
    its FUSE export is a file, and a loop device makes a file a block
    device. So this kind owns the three layers (export, loop device,
    filesystem) and their order: up in `bring_up`, down in `tear_down`,
    which waits for a filesystem to end everywhere before it removes what it
    writes through.
    """

    kind = ExportKind.FILESYSTEM

    def export_file(self, volume_id: str) -> Path:
        return export_file(self.host.exports_dir, volume_id)

    def fs_type(self, block: bool, requested: str) -> str:
        return "" if block else filesystems.check_fs_type(requested)

    def export_broken(self, volume_id: str) -> bool:
        """True if the volume's FUSE file answers ENOTCONN: the QSD behind it is gone."""
        try:
            os.stat(self.export_file(volume_id))
        except OSError as exc:
            return exc.errno == errno.ENOTCONN
        return False

    async def bring_up(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], client: QSDClient,
    ) -> StageRecord:
        """Make the stage whole: the image open in QSD, its FUSE export, a loop device, the filesystem mounted.

        Idempotent, for a first stage, a retry and the rebuild after QSD
        died: a fresh export means QSD lost the old one, so the loop device
        and mounts on it are dead and are dropped first (lazily). The
        image's zeroes are asked before QSD opens it, so a volume never
        written gets its filesystem without a probe. Returns the stage with
        its loop device and filesystem type. Raises FailedPrecondition (a
        filesystem other than the one asked for), QSDError.
        """
        top = self.host.top_image(volume)
        export = self.export_file(volume.id)
        # Asked before QSD opens the image: a volume never written needs no probe for a filesystem.
        blank = stage.access_type is AccessType.MOUNT and await asyncio.to_thread(
            self.host.pools[volume.pool].reads_as_zeros, volume.image)
        fresh_export = not await export_nodes.has_export(client, top.nodes.fuse_export)
        if fresh_export:
            await self._drop_stale_host_state(volume, stage, publishes)
        daemon = self.host.daemon_of(volume.id)
        spec = (export_nodes.fuse_export(top, export, writable=True, iothreads=daemon.fuse_iothreads(),
                                   io_uring=daemon.fuse_paths.io_uring, growable=daemon.fuse_paths.growable)
                if fresh_export else None)
        # A growable export stands on a size guard made at the image's length, once it is open.
        batched = spec if spec is not None and not spec.get("growable") else None
        if not await attach.ensure_top(client, top, export=batched) and spec is not None:
            await export_nodes.add_fuse_export(client, top, spec)
        self.host.failpoints.hit("stage.after_export")
        # Both wait for QSD to answer the FUSE file (a stat, an open): asked together. A crash before the
        # limit is raised leaves the stage row STAGING, and the kubelet's retry exports afresh.
        attaching = self._loop_for(export, stage.loop_device, fresh_export)
        if fresh_export:
            device, _raised = await asyncio.gather(attaching, fusectl.raise_background(export))
        else:
            device = await attaching
        self.host.failpoints.hit("stage.after_loop")
        stage = dataclasses.replace(stage, loop_device=str(device))
        if stage.access_type is AccessType.MOUNT:
            try:
                fs_type = await filesystem.ensure_staged(
                    device, stage.staging_path, stage.fs_type, list(stage.mount_flags), blank=blank)
            except FailedPrecondition as exc:
                raise FailedPrecondition(f"volume {volume.id}: {exc}") from exc
            self.host.failpoints.hit("stage.after_mount")
            if stage.mount_group:
                await asyncio.to_thread(_apply_group, stage.staging_path, stage.mount_group)
            stage = dataclasses.replace(stage, fs_type=fs_type)
        return stage

    async def tear_down(self, volume: VolumeRecord, stage: StageRecord, client: QSDClient, *, thorough: bool) -> None:
        """`thorough` also finds loop devices the catalog never recorded (a crash between attach and commit)."""
        export = self.export_file(volume.id)
        if stage.access_type is AccessType.MOUNT:
            entry = mounts.mounted_at(stage.staging_path)
            if entry is not None and _stands_on_our_loop(entry.source, export, stage):
                await filesystem.unstage(stage.staging_path)
        self.host.failpoints.hit("unstage.after_unmount")
        devices = {Path(stage.loop_device)} if stage.loop_device else set()
        if thorough:
            devices |= {lp.device for lp in loop.find_loop(export)}
        serving = sorted(device for device in devices if loop.serves(device, export))
        # Behind a dead export nothing can be written any more, so there is nothing to wait for.
        alive = not self.export_broken(volume.id)
        if alive and stage.access_type is AccessType.MOUNT:
            for device in serving:
                await self._wait_filesystem_gone(volume, stage, device)
        for device in serving:
            await loop.detach(device)
        if alive:
            for device in serving:
                await self._wait_device_released(volume, device, export)
        self.host.failpoints.hit("unstage.after_detach")
        await attach.remove_volume(client, volume.id)
        if mounts.mounted_at(export) is not None:
            await mounts.unmount(export, lazy=True)
        await asyncio.to_thread(shutil.rmtree, self.host.volume_dir(volume.id), True)

    @staticmethod
    async def _wait_filesystem_gone(volume: VolumeRecord, stage: StageRecord, device: Path) -> None:
        """Keep the device and its export until the volume's filesystem has ended everywhere.

        A filesystem still mounted in another mount namespace (a pod's whose
        last process is still exiting) writes its dirty data and journal when
        that last copy goes: detaching the device or removing the export
        first would lose those writes. Raises StillInUse.
        """
        started = time.monotonic()
        released = await loop.wait_unheld(device, FILESYSTEM_RELEASE_SECONDS)
        waited = time.monotonic() - started
        if released and waited > 0.05:  # it was held: say so, it explains a slow unstage
            log.info("event=filesystem_released volume_id=%s device=%s waited=%.2f", volume.id, device, waited)
        if not released:
            raise StillInUse(
                f"volume {volume.id}: its filesystem on {device} is unmounted from {stage.staging_path} but still "
                f"mounted elsewhere (another mount namespace, such as a pod's that has not ended, or a mount made by "
                f"hand) after {FILESYSTEM_RELEASE_SECONDS:g} s; the device and the export stay so that no write is "
                f"lost: unmount it there, and NodeUnstageVolume succeeds on retry"
            )

    @staticmethod
    async def _wait_device_released(volume: VolumeRecord, device: Path, export: Path) -> None:
        """Keep the export until the detached device has let go of it (a process may still have it open).

        Raises StillInUse.
        """
        if await loop.wait_released(device, export, FILESYSTEM_RELEASE_SECONDS):
            return
        raise StillInUse(
            f"volume {volume.id}: its loop device {device} is still open after {FILESYSTEM_RELEASE_SECONDS:g} s "
            f"(a process of a pod that has not ended, or one started by hand); it is detached and goes on its last "
            f"close, and the export stays until then so that no write is lost: NodeUnstageVolume succeeds on retry"
        )

    async def publish(
        self, volume: VolumeRecord, stage: StageRecord, record: PublishRecord, others: list[PublishRecord],
    ) -> PublishRecord:
        if stage.access_type is AccessType.MOUNT:
            await filesystem.ensure_published(
                stage.staging_path, record.target_path, readonly=record.readonly, flags=list(record.mount_flags),
                cover=_on_dead_export,
            )
            return record
        device = Path(stage.loop_device)
        if record.readonly:
            # A read-only bind of a writable device still lets the pod write: give it a read-only loop device.
            export = self.export_file(volume.id)
            mine = Path(record.loop_device) if record.loop_device else None
            if mine is None or mine not in {lp.device for lp in loop.find_loop(export, readonly=True)}:
                mine = await loop.attach(export, readonly=True, direct_io=loop.uses_direct_io(device))
                record = dataclasses.replace(record, loop_device=str(mine))
            device = mine
        await block.ensure_published(device, record.target_path, readonly=record.readonly)
        return record

    async def unpublish(self, volume: VolumeRecord, stage: StageRecord | None, record: PublishRecord) -> None:
        if stage is not None and stage.access_type is AccessType.BLOCK:
            await block.unpublish(record.target_path)
        elif stage is not None:
            await filesystem.unpublish(record.target_path)
        elif record.target_path.is_dir():  # the stage row is gone (a crash): the target's own kind decides
            await filesystem.unpublish(record.target_path)
        else:
            await block.unpublish(record.target_path)
        self.host.failpoints.hit("unpublish.after_unmount")
        if record.loop_device:
            await loop.detach(Path(record.loop_device))

    async def condition(self, volume: VolumeRecord) -> tuple[bool, str]:
        export_id = graph.nodes_for(volume.id).fuse_export
        if not await export_nodes.has_export(self.host.client_of(volume.id), export_id):
            return True, f"export {export_id} is missing from qemu-storage-daemon"
        if self.export_broken(volume.id):
            return True, f"the FUSE export of volume {volume.id} is not connected to qemu-storage-daemon"
        return False, "volume is healthy"

    async def stats(self, volume: VolumeRecord, stage: StageRecord, path: Path) -> VolumeStats:
        abnormal, message = await self.condition(volume)
        if stage.access_type is AccessType.BLOCK:
            return VolumeStats(block=True, total_bytes=volume.capacity, available_bytes=0, used_bytes=0,
                               abnormal=abnormal, message=message)
        if mounts.mounted_at(path) is None:
            raise NotFound(f"volume {volume.id} has no filesystem mounted at {path}")
        st = await asyncio.to_thread(os.statvfs, path)
        return VolumeStats(
            block=False, total_bytes=st.f_blocks * st.f_frsize, available_bytes=st.f_bavail * st.f_frsize,
            used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize, total_inodes=st.f_files,
            available_inodes=st.f_favail, used_inodes=st.f_files - st.f_ffree, abnormal=abnormal, message=message,
        )

    async def check_expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        """ext4 grows in use only with CAP_SYS_RESOURCE (the kernel refuses root without it).

        One that already fills the size passes, so the call stays idempotent: kubelet repeats it after a lost
        answer, and a volume grown while no pod had it has nothing left to grow once one has it.
        """
        if publishes and self._offline_ext4(stage) and not await self._ext4_fills(stage, size):
            raise FailedPrecondition(
                f"volume {volume.id} holds ext4, which grows while in use only if the plugin has the "
                "CAP_SYS_RESOURCE capability, and this one lacks it: give the plugin container that capability "
                f"(or run it privileged), or unpublish the volume from {publishes[0].target_path} and retry"
            )

    @staticmethod
    async def _ext4_fills(stage: StageRecord, size: int) -> bool:
        return bool(stage.loop_device) and await filesystems.ext4_fills(Path(stage.loop_device), size)

    @staticmethod
    def _offline_ext4(stage: StageRecord) -> bool:
        return stage.access_type is AccessType.MOUNT and stage.fs_type == "ext4" and not caps.has(caps.CAP_SYS_RESOURCE)

    async def expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        """Grow the image live, then every loop device on the export, then the filesystem.

        xfs grows online. ext4 grows online only with CAP_SYS_RESOURCE (the
        kernel refuses root without it); lacking it, an ext4 volume no pod
        uses is grown offline (unmounted for a moment), and one in use is
        refused by `check_expand` before anything changes.
        """
        mounted = stage.access_type is AccessType.MOUNT
        offline_ext4 = self._offline_ext4(stage)
        if size > volume.capacity:
            await attach.resize(self.host.client_of(volume.id), self.host.top_image(volume), size)
        for device in [stage.loop_device, *(p.loop_device for p in publishes)]:
            if device:
                await loop.refresh_capacity(Path(device), size)
        if offline_ext4 and await self._ext4_fills(stage, size):
            return
        if offline_ext4:
            await filesystem.unstage(stage.staging_path)
            await filesystem.ensure_staged(
                Path(stage.loop_device), stage.staging_path, stage.fs_type, list(stage.mount_flags))
        elif mounted:
            await filesystems.grow(stage.staging_path, stage.fs_type, Path(stage.loop_device))

    @contextlib.asynccontextmanager
    async def quiesced(self, volume: VolumeRecord, stage: StageRecord) -> AsyncIterator[None]:
        """A mounted filesystem is frozen (fsfreeze) so the image left behind is consistent."""
        if stage.access_type is not AccessType.MOUNT:
            yield
            return
        await filesystems.freeze(stage.staging_path)
        try:
            yield
        finally:
            await filesystems.thaw(stage.staging_path)

    async def release(self, volume: VolumeRecord, stage: StageRecord) -> None:
        """Thaw a filesystem a crash left frozen (fsfreeze refuses one that is not: harmless)."""
        if stage.access_type is AccessType.MOUNT and mounts.mounted_at(stage.staging_path) is not None:
            await filesystems.thaw(stage.staging_path)

    def check_move(self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord]) -> None:
        """The last copy of a move needs the writers held still: a filesystem freezes, a raw device a pod has does not."""
        if stage.access_type is AccessType.BLOCK and publishes:
            raise FailedPrecondition(
                f"volume {volume.id} must move to a larger extent of its pool to grow, and the last part of a move "
                f"needs its writers held still, which a raw block device in use cannot be: unpublish it from "
                f"{publishes[0].target_path} and retry (a filesystem volume moves while in use)"
            )

    async def _loop_for(self, export: Path, recorded: str, fresh_export: bool) -> Path:
        """The volume's read-write loop device: the recorded one, a found one (after a crash), or a new one."""
        if recorded and loop.serves(Path(recorded), export):
            return Path(recorded)
        if not fresh_export:
            found = loop.find_loop(export, readonly=False)
            if found:
                return found[0].device
        return await loop.attach(export, direct_io=self.host.qsd.loop_direct_io)

    async def _drop_stale_host_state(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord]
    ) -> None:
        """After QSD lost the export: lazily drop the mounts and loop devices on the dead FUSE file."""
        export = self.export_file(volume.id)
        if not os.path.lexists(export.parent):
            return  # never exported on this node: nothing can be stale
        stale = [lp.device for lp in loop.find_loop(export)]
        # The one the catalog recorded, once its FUSE file is gone, shows no path of ours (sysfs says "/").
        if stage.loop_device and loop.backing_of(Path(stage.loop_device)) == ORPHANED \
                and not loop.serves(Path(stage.loop_device), export):
            stale.append(Path(stage.loop_device))
        if not stale and mounts.mounted_at(export) is None:
            return
        log.warning("event=drop_stale volume_id=%s loops=%s", volume.id, [str(device) for device in stale])
        if stage.access_type is AccessType.BLOCK:
            for publish in publishes:
                await mounts.unmount(publish.target_path, lazy=True)
        # A filesystem's targets keep their dead mount until `publish` mounts the new one over it, so that a
        # container with mountPropagation HostToContainer receives the new one (`filesystem.ensure_published`).
        if stage.access_type is AccessType.MOUNT:
            entry = mounts.mounted_at(stage.staging_path)
            if entry is not None and (Path(entry.source) in stale or _is_loop_over(entry.source, export)):
                await mounts.unmount(stage.staging_path, lazy=True)
        for device in stale:
            await loop.detach(device)
        await mounts.unmount(export, lazy=True)


# What sysfs gives as the backing file of a loop device whose file lay on a FUSE mount that is gone.
ORPHANED = Path("/")


def _on_dead_export(entry: mounts.MountEntry) -> bool:
    """True if a mount stands on a loop device whose FUSE file is gone (or that is detached): it is dead."""
    if not entry.source.startswith("/dev/loop"):
        return False
    backing = loop.backing_of(Path(entry.source))
    return backing is None or backing == ORPHANED


def _is_loop_over(source: str, export: Path) -> bool:
    """True if mount source `source` is a loop device whose backing file is `export`."""
    return source.startswith("/dev/loop") and loop.serves(Path(source), export)


def _stands_on_our_loop(source: str, export: Path, stage: StageRecord) -> bool:
    """True if mount source `source` is the volume's loop device: over `export`, or the one the stage recorded
    with its file unreachable from here.

    A loop device attached by an earlier process of the plugin, in a mount
    namespace that has since gone (its container restarted), names its file
    "/" in sysfs; once QSD has died too, the dead export has no identity to
    compare either. Only the recorded device is known to be ours then.
    """
    if _is_loop_over(source, export):
        return True
    return bool(stage.loop_device) and source == stage.loop_device and loop.backing_of(Path(source)) == ORPHANED


def _apply_group(root: Path, group: str) -> None:
    """Give the filesystem to the pod's group, VOLUME_MOUNT_GROUP, as kubelet gives it a pod's fsGroup.

    kubelet leaves a pod's fsGroup to a driver that takes VOLUME_MOUNT_GROUP, so the driver does what
    kubelet would (fsGroupChangePolicy OnRootMismatch): when the root is not the group's yet (a new volume,
    or a pod of another fsGroup after the last one left), every file and directory on this filesystem goes
    to the group, group-readable and writable, directories setgid, so files made later inherit it. Links
    are not followed, and nothing on another filesystem mounted below is touched.

    The pod may still write the filesystem (a re-stage after a kubelet restart), so no path is resolved
    twice: the walk holds a descriptor of each directory, opened without following a link, lists and
    changes each entry relative to it, and acts on the very inode it looked at (`_give_to_group`). A
    directory swapped for a link mid-walk is skipped, never entered.
    """
    gid = int(group)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_gid != gid:
            _give_below(fd, st.st_dev, gid)
        os.fchown(fd, -1, gid)
        os.fchmod(fd, (os.fstat(fd).st_mode & 0o7777) | 0o2070)
    finally:
        os.close(fd)


def _give_below(dir_fd: int, dev: int, gid: int) -> None:
    """`_give_to_group` every entry of the directory `dir_fd`, and below each directory on device `dev`."""
    with os.scandir(dir_fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:  # removed since it was listed
            continue
        try:
            found = os.fstat(fd)
            if stat.S_ISLNK(found.st_mode):
                os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
                continue
            if stat.S_ISDIR(found.st_mode) and found.st_dev == dev:
                try:
                    below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError:  # swapped for a link or a file since (ELOOP, ENOTDIR), or gone: not entered
                    continue
                try:
                    if os.path.samestat(os.fstat(below), found):
                        _give_below(below, dev, gid)
                finally:
                    os.close(below)
            _give_to_group(fd, gid)
        finally:
            os.close(fd)


def _give_to_group(fd: int, gid: int) -> None:
    """chown to `gid` and open up to the group the inode of the O_PATH descriptor `fd` (the kernel resolves
    /proc/self/fd/N to that inode, whatever its name points to now)."""
    inode = f"/proc/self/fd/{fd}"
    os.chown(inode, -1, gid)
    entry = os.fstat(fd)  # after: the kernel drops a file's setuid and setgid bits on chown
    if stat.S_ISDIR(entry.st_mode):
        os.chmod(inode, (entry.st_mode & 0o7777) | 0o2070)
    elif stat.S_ISREG(entry.st_mode):
        os.chmod(inode, (entry.st_mode & 0o7777) | 0o060)
