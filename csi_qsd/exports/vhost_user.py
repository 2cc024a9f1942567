"""VM pods: a vhost-user-blk export whose socket directory is bind-mounted at the target.

A socket serves one VM at a time (a second client's QEMU hangs at start-up on
QSD 7.2), so a second publish is refused, and a publish re-adds the export in
its own mode: a readonly publish gives the guest a read-only disk.

The target may reach a VM that Kubernetes never told the driver of: hotplug
publishes to an attachment pod and a node agent bind-mounts that into the
VM's pod. So the socket belongs to the VMM's group when the StorageClass
names one (`vmmGroup`), and a volume is never unpublished or unstaged while a
vhost-user client is connected to its socket (the kernel's socket table says
so, `csi_qsd.sys.unix_peers`): the call answers FAILED_PRECONDITION and the
CO's retry succeeds once the VM let go of the disk.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd.catalog import PublishRecord, PublishState, StageRecord, VolumeRecord
from csi_qsd.errors import FailedPrecondition, Unavailable
from csi_qsd.exports.base import ExportPath, VolumeStats, refuse_block
from csi_qsd.params import ExportKind
from csi_qsd.publish import vhost_user
from csi_qsd.qsd import attach, export_nodes, features, graph
from csi_qsd.qsd import move as qsd_move
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.iothreads import IOThreadPool
from csi_qsd.sys import unix_peers, vhost_channels

log = logging.getLogger(__name__)

# How long a growth waits for QSD to accept connections made before its socket was hidden, and how often it looks.
BACKLOG_SECONDS = 2.0
BACKLOG_POLL_SECONDS = 0.02


class VhostUserExport(ExportPath):
    """VM volumes: QSD serves the image as a vhost-user-blk socket, which QEMU in the pod connects to.

    No loop device, no filesystem, no FUSE: the guest's requests reach QSD
    through shared memory, the shortest path QSD offers. The socket lives
    in a directory of its own, published into the pod, whose group lets the
    VM's user connect and no one else.
    """

    kind = ExportKind.VHOST_USER_BLK

    def socket_dir(self, volume_id: str) -> Path:
        return self.host.volume_dir(volume_id) / "vhost"

    @staticmethod
    def group(volume: VolumeRecord, stage: StageRecord) -> str:
        """The group that may open the socket: the VMM's from the StorageClass, else the staging pod's."""
        return volume.params.vmm_group or stage.mount_group

    def check_access(self, volume: VolumeRecord, block: bool) -> None:
        if block:
            refuse_block(volume, "vhost-user-blk")

    async def bring_up(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], client: QSDClient,
    ) -> StageRecord:
        top = self.host.top_image(volume)
        await attach.ensure_top(client, top)
        socket_dir = self.socket_dir(volume.id)
        vhost_user.prepare_dir(socket_dir, self.group(volume, stage))
        await asyncio.to_thread(vhost_user.unhide, socket_dir)  # a growth the driver did not live to finish
        socket = socket_dir / vhost_user.SOCKET_NAME
        writable = not any(p.readonly for p in publishes)  # the one publish's mode
        await export_nodes.ensure_vhost_export(client, top, socket, writable=writable, iothreads=self._iothreads(volume))
        vhost_user.restrict_socket(socket, self.group(volume, stage))
        return stage

    def _iothreads(self, volume: VolumeRecord) -> IOThreadPool | None:
        """The iothreads this QSD can run the export in (see datapath); a polling budget is lost if none."""
        pool = self.host.daemon_of(volume.id).vhost_iothreads()
        if pool is not None:
            return pool
        if volume.params.iothread_poll_max_ns is not None:
            log.warning("event=iothread_poll_ignored volume_id=%s qsd_version=%s reason=%s", volume.id,
                        ".".join(map(str, self.host.qsd.version)),
                        "vhost-user-blk exports run in QSD's main loop on this version")
        return None

    async def tear_down(self, volume: VolumeRecord, stage: StageRecord, client: QSDClient, *, thorough: bool) -> None:
        await attach.remove_volume(client, volume.id)
        await asyncio.to_thread(shutil.rmtree, self.host.volume_dir(volume.id), True)

    async def publish(
        self, volume: VolumeRecord, stage: StageRecord, record: PublishRecord, others: list[PublishRecord],
    ) -> PublishRecord:
        """Raises FailedPrecondition when another target already has the socket."""
        if others:
            raise FailedPrecondition(
                f"volume {volume.id} is already published at {others[0].target_path}; a vhost-user-blk "
                "volume serves one VM at a time: unpublish it there first"
            )
        socket_dir = self.socket_dir(volume.id)
        if record.state is PublishState.PUBLISHING:
            # No VM can be connected (no other publish): re-add the export in this publish's mode.
            top = self.host.top_image(volume)
            socket = socket_dir / vhost_user.SOCKET_NAME
            await self.host.client_of(volume.id).export_del(top.nodes.vhost_export)
            await export_nodes.ensure_vhost_export(self.host.client_of(volume.id), top, socket, writable=not record.readonly,
                                             iothreads=self._iothreads(volume))
            vhost_user.restrict_socket(socket, self.group(volume, stage))
        await vhost_user.ensure_published(socket_dir, record.target_path)
        if group := self.group(volume, stage):
            await vhost_user.check_openable(record.target_path, group)
        return record

    def check_publish(self, volume: VolumeRecord, stage: StageRecord, mount_group: str) -> None:
        """A pod of another group than the one the socket was staged for could not open it: refused."""
        if volume.params.vmm_group or not mount_group or mount_group == stage.mount_group:
            return
        held = f"group {stage.mount_group}" if stage.mount_group else "root alone"
        raise FailedPrecondition(
            f"volume {volume.id}'s vhost-user-blk socket was staged for {held} and this pod's "
            f"volume_mount_group is {mount_group}: its VMM could not open the socket. Unstage the volume "
            "first, or name the VMM's group in the StorageClass parameter vmmGroup"
        )

    async def check_unused(self, volume: VolumeRecord, stage: StageRecord | None) -> None:
        """Raises FailedPrecondition while a vhost-user client is connected to the volume's socket."""
        if stage is None:
            return
        socket = self.socket_dir(volume.id) / vhost_user.SOCKET_NAME
        if not self.host.daemon_of(volume.id).ready:
            raise Unavailable(
                f"qemu-storage-daemon is restarting: whether a VM still has volume {volume.id} open cannot be "
                "told until it is back; retry shortly"
            )
        peers = await asyncio.to_thread(unix_peers.peers, socket)
        if peers.clients:
            raise FailedPrecondition(
                f"volume {volume.id} is in use: a vhost-user client (a VM's QEMU) is connected to its socket "
                f"{socket}. Detach the disk from the VM (device_del, then chardev-remove) or stop the VM; "
                "a retry succeeds once it let go"
            )
        if not peers.listening and await export_nodes.has_export(self.host.client_of(volume.id), graph.nodes_for(volume.id).vhost_export):
            raise Unavailable(
                f"qemu-storage-daemon exports volume {volume.id} at {socket} but no listening socket is in this "
                "network namespace: run the plugin in qemu-storage-daemon's network namespace"
            )

    async def unpublish(self, volume: VolumeRecord, stage: StageRecord | None, record: PublishRecord) -> None:
        await vhost_user.unpublish(record.target_path)

    async def condition(self, volume: VolumeRecord) -> tuple[bool, str]:
        export_id = graph.nodes_for(volume.id).vhost_export
        if not await export_nodes.has_export(self.host.client_of(volume.id), export_id):
            return True, f"export {export_id} is missing from qemu-storage-daemon"
        return False, "volume is healthy"

    async def stats(self, volume: VolumeRecord, stage: StageRecord, path: Path) -> VolumeStats:
        abnormal, message = await self.condition(volume)
        return VolumeStats(block=True, total_bytes=volume.capacity, available_bytes=0, used_bytes=0,
                           abnormal=abnormal, message=message)

    async def check_expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        """A published disk grows only where a running VM is told of it: QSD >= 10, and not a fixed window;
        and never under a connected client that set up no back-end channel (QSD would die telling it)."""
        if size <= volume.capacity:
            return
        if self._live(volume):
            await self._refuse_client_without_channel(volume)
            return
        if not publishes:
            return
        if self._fixed(volume):
            raise FailedPrecondition(
                f"volume {volume.id} is published at {publishes[0].target_path}: its extent of device pool "
                f"{volume.pool} grows by reopening qemu-storage-daemon's fixed-size window, which a running VM "
                "is not told of; stop the VM and unpublish the volume, then retry"
            )
        raise FailedPrecondition(
            f"volume {volume.id} is published at {publishes[0].target_path}: qemu-storage-daemon "
            f"{'.'.join(map(str, self.host.qsd.version))} cannot grow a disk under a running VM; "
            "stop the VM and unpublish the volume, or upgrade QSD to 10.0 or newer"
        )

    async def _refuse_client_without_channel(self, volume: VolumeRecord) -> None:
        """Raises FailedPrecondition while a client connected to the volume's socket has no back-end channel,
        or while one is connected and that cannot be told.

        QSD 10.0.13 tells a connected client of a growth over the back-end
        channel whether or not the client set one up, and dies where it did
        not (libblkio's driver): measured, SIGSEGV after "vu_panic: Error
        while writing: Bad file descriptor", while a guest's QEMU on another
        export of the same QSD saw 131072 -> 262144 sectors live. The CO
        retries the call; it succeeds once that client is gone (it sees the
        new size when it connects again). Asked first in `check_expand`, and
        again in `expand` with the socket hidden, so that no client can
        connect between this check and the resize.
        """
        socket = self.socket_dir(volume.id) / vhost_user.SOCKET_NAME
        if not (await asyncio.to_thread(unix_peers.peers, socket)).clients:
            return
        pid = self.host.daemon_of(volume.id).pid
        try:
            if pid is None:
                raise OSError(errno.ESRCH, "qemu-storage-daemon's process is not visible from the plugin")
            verdict = await asyncio.to_thread(_channels, pid, socket)
        except OSError as error:
            raise FailedPrecondition(
                f"volume {volume.id} cannot grow while a vhost-user client is connected to its socket {socket}: "
                f"whether that client can be told of a new size cannot be checked ({error}); reading "
                "qemu-storage-daemon's descriptors needs its PID namespace and CAP_SYS_PTRACE. Disconnect the "
                "client (stop the VM) and retry"
            ) from error
        log.info("event=expand_clients volume_id=%s clients=%d without_channel=%d exact=%s", volume.id,
                 verdict.clients, verdict.without_channel, verdict.exact)
        if verdict.without_channel:
            pids = f" (PID {', '.join(map(str, verdict.pids))})" if verdict.pids else ""
            apart = "" if verdict.exact else (
                " (clients cannot be told apart on this kernel: one without a channel on any volume of this "
                "qemu-storage-daemon is enough to refuse)")
            raise FailedPrecondition(
                f"volume {volume.id} cannot grow now: a vhost-user client connected to its socket {socket}{pids} "
                "set up no back-end channel (libblkio's virtio-blk-vhost-user driver, as in qemu-io or qemu-img, "
                "sets up none), and qemu-storage-daemon would crash telling it of the new size, taking every "
                f"volume of the node down{apart}. Disconnect that client and retry: it sees the new size when it "
                "connects again. A VM's QEMU (vhost-user-blk-pci) takes the growth live"
            )

    async def _resize_hidden(self, volume: VolumeRecord, top: attach.TopImage, size: int) -> None:
        """block_resize with the socket out of the pod's sight (`vhost_user.hide`), so the clients QSD will tell
        of the growth are the ones checked just before it.

        A client could connect after `check_expand` asked, while the image
        grew on disk, and QSD would die telling it (and every volume of the
        node with it). With the socket hidden no connect() finds it, so:
        wait until QSD accepted every connection already made (its backlog
        empty), ask again, resize, and put the socket back. A backlog that
        does not drain (QSD serves one client at a time and another waits)
        is FAILED_PRECONDITION: that client would be served next, unchecked.
        """
        socket_dir = self.socket_dir(volume.id)
        socket = socket_dir / vhost_user.SOCKET_NAME
        await asyncio.to_thread(vhost_user.hide, socket_dir)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + BACKLOG_SECONDS
            while (await asyncio.to_thread(unix_peers.peers, socket)).waiting:
                if loop.time() >= deadline:
                    raise FailedPrecondition(
                        f"volume {volume.id} cannot grow now: a vhost-user client waits to connect to its socket "
                        f"{socket} while another is served, and it would be served unchecked; retry once the VM's "
                        "clients settled")
                await asyncio.sleep(BACKLOG_POLL_SECONDS)
            await self._refuse_client_without_channel(volume)
            await attach.resize(self.host.client_of(volume.id), top, size)
        finally:
            await asyncio.to_thread(vhost_user.unhide, socket_dir)

    def _live(self, volume: VolumeRecord) -> bool:
        """True if a resize under the export reaches a connected guest (block_resize on QSD >= 10)."""
        return features.live_resize_reaches_guest(self.host.qsd.version) and not self._fixed(volume)

    def _fixed(self, volume: VolumeRecord) -> bool:
        """True for a device pool's extent: a window of fixed size that only a reopen can grow."""
        return self.host.top_image(volume).storage.max_size() is not None

    async def move(
        self, volume: VolumeRecord, stage: StageRecord, old: attach.TopImage, new: attach.TopImage,
        commit: Callable[[], Awaitable[None]],
    ) -> None:
        """A mirror under the export (it holds no RESIZE permission), committed once actively synced."""
        await qsd_move.open_new_home(self.host.client_of(volume.id), new)
        await qsd_move.mirror(self.host.client_of(volume.id), old, new, commit)

    async def finish_move(self, volume: VolumeRecord, stage: StageRecord, old: attach.TopImage,
                          new: attach.TopImage) -> None:
        """The mirror again (the running job, or a new one: the old top kept every write until the switch)."""
        await qsd_move.open_new_home(self.host.client_of(volume.id), new)
        await qsd_move.mirror(self.host.client_of(volume.id), old, new)

    async def expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        """Grow the image under the export; a running guest sees it at once where QSD tells it (QEMU >= 10).

        Measured on 10.0.13: the guest saw the new size 14-101 ms after
        block_resize, with no reconnect. A guest that reconnects instead keeps
        its old size, so the export is never re-added here. Nothing happens
        when the size does not grow: a retry must not touch the guest. QSD 7.2
        never tells the guest and wedged when the export was removed under a
        connected VM, and a device pool's fixed window is grown by a reopen
        that no guest is told of: there a published volume is refused
        (`check_expand`) and an unpublished one has its export re-added around
        the resize, so the next VM sees the new size.
        """
        if size <= volume.capacity:
            return
        top = self.host.top_image(volume)
        client = self.host.client_of(volume.id)
        if self._live(volume):
            await self._resize_hidden(volume, top, size)
            return
        await client.export_del(top.nodes.vhost_export)
        await attach.resize(client, top, size)
        await self.bring_up(volume, stage, publishes, client)


def _channels(pid: int, socket: Path) -> vhost_channels.Verdict:
    """Which clients of `socket` lack a back-end channel, from QSD's (`pid`) descriptors. Raises OSError."""
    suffix = "/" + vhost_user.SOCKET_NAME
    return vhost_channels.inspect(pid, socket, lambda name: name.endswith(suffix), unix_peers.closed_by_peer())
