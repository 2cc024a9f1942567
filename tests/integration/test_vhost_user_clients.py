"""A published vhost-user-blk socket used by a client that is not QEMU's device: libblkio.

libblkio's `virtio-blk-vhost-user` driver (Debian's qemu-block-extra, bundled
with the runtime) speaks vhost-user to the socket from `qemu-io`, here as the
VMM's user and group (107:107) from inside the published directory, as a VMM
in the VM's pod would. It does verified I/O, finds every acknowledged byte
after a QSD SIGKILL and restart, and sees the volume grown. Ownership: a
class naming `vmmGroup` gives the socket to that group whatever the staging
pod's fsGroup; a publish for a pod of another group than the stage's, without
`vmmGroup`, is refused. While a client is connected, NodeUnpublishVolume is
FAILED_PRECONDITION; the retry after it left succeeds.

Measured on QSD 10.0.13: a `block_resize` under the export while a libblkio
client is connected kills QSD (SIGSEGV after "vu_panic: Error while writing:
Bad file descriptor"): libblkio sets up no back-end channel and QSD writes
the config-change message to it anyway. So NodeExpandVolume is refused while
such a client is connected (pinned below); a guest's QEMU sets one up and
sees the growth live (e2e/test_vm_qsd10.py); a libblkio client sees it when
it connects after the growth.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import stat
import subprocess
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.errors import FailedPrecondition
from csi_qsd.exports.vhost_user import VhostUserExport
from csi_qsd.publish import vhost_user
from csi_qsd.qsd import attach
from csi_qsd.server import Driver
from csi_qsd.sys import unix_peers
from csi_qsd.sys.tools import bundled
from testing import tiers
from testing.harness import Sandbox, qemu_io_session, qsd_pid, until, wait_new_qsd

MIB = 1 << 20
SIZE = 64 * MIB
VMM = 107
ATTACHMENT_GROUP = "2000"
SOCKET = vhost_user.SOCKET_NAME
TIMEOUT_S = 60.0


def blkio_missing() -> bool:
    try:
        out = subprocess.run([bundled("qemu-img"), "--help"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return True
    return "virtio-blk-vhost-user" not in out


needs_blkio = tiers.needs("integration", "the bundled QEMU's virtio-blk-vhost-user driver (libblkio, qemu-block-extra)"
                          if blkio_missing() else "")


def client_argv(uid: int, gid: int, *commands: str) -> list[str]:
    """qemu-io on the socket in the current directory, as uid:gid with no other group."""
    argv = [bundled("qemu-io"), "--image-opts", f"driver=virtio-blk-vhost-user,path={SOCKET},cache.direct=on"]
    for command in commands:
        argv += ["-c", command]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]


async def blkio(target: Path, *commands: str, uid: int = VMM, gid: int = VMM) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *client_argv(uid, gid, *commands), cwd=target, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def verified(target: Path, *commands: str) -> str:
    code, out = await blkio(target, *commands)
    assert code == 0 and "failed" not in out, out
    return out


def connected_client(target: Path) -> contextlib.AbstractAsyncContextManager[None]:
    """A libblkio client that stays connected (qemu-io reading commands) until the block ends."""
    return qemu_io_session(client_argv(VMM, VMM), "read -P 0x5a 0 1M", cwd=target, timeout=TIMEOUT_S)


async def published_with_data(box: Sandbox, csi: CSIClient, name: str) -> tuple[str, Path, Path, Path]:
    """A vhost-user-blk volume `name` for the VMM's group, staged and published, its first 4 MiB written (0x5a)
    through a libblkio client: (volume ID, staging path, target, the socket's address in QSD)."""
    vid = (await csi.create_volume(name, SIZE, {"export": "vhost-user-blk", "vmmGroup": str(VMM)})).volume_id
    staging, target = box.staging(name), box.target(name)
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    await verified(target, "write -P 0x5a 0 4M")
    return vid, staging, target, box.state_dir / "exports" / vid / "vhost" / SOCKET


def owner(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


async def refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@needs_blkio
async def test_libblkio_client_does_verified_io_through_a_qsd_restart_and_growth(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    _, csi = driver
    vid = (await csi.create_volume("vm-blkio", SIZE, {"export": "vhost-user-blk", "vmmGroup": str(VMM)})).volume_id
    staging, target = box.staging("vm-blkio"), box.target("hp-attach")
    await csi.stage(vid, str(staging), mount_group=ATTACHMENT_GROUP)
    await csi.publish(vid, str(staging), str(target), mount_group=ATTACHMENT_GROUP)
    export = box.state_dir / "exports" / vid / "vhost" / SOCKET  # the address QSD listens on
    # The VMM's group owns the socket, not the attachment pod's fsGroup.
    assert owner(target) == (0, VMM, 0o750) and owner(target / SOCKET) == (0, VMM, 0o660)
    code, out = await blkio(target, "read 0 4k", uid=65534, gid=int(ATTACHMENT_GROUP))
    assert code != 0, f"a process of the attachment pod's group must not open the socket: {out}"

    out = await verified(target, "length", "write -P 0x5a 0 4M", "read -P 0x5a 0 4M")
    assert "64 MiB" in out.splitlines(), out

    # Grown while no libblkio client is connected (see the module docstring): the next one sees it.
    assert await csi.expand(vid, str(target), 2 * SIZE) == 2 * SIZE
    out = await verified(target, "length", "write -P 0x3c 127M 1M", "read -P 0x3c 127M 1M", "read -P 0x5a 0 4M")
    assert "128 MiB" in out.splitlines(), out

    # QSD dies; the supervisor brings the export back and every acknowledged byte is there.
    old = qsd_pid(box)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await wait_new_qsd(box, old)
    await until(lambda: unix_peers.peers(export).listening and owner(target / SOCKET)[1] == VMM,
                "the export back, owned by the VMM's group", TIMEOUT_S)
    out = await verified(target, "length", "read -P 0x5a 0 4M", "read -P 0x3c 127M 1M",
                         "write -P 0xa5 4M 4M", "read -P 0xa5 4M 4M")
    assert "128 MiB" in out.splitlines(), out

    # Connected: the attachment pod's unpublish is refused, and so is the unstage; the target stays.
    async with connected_client(target):
        assert unix_peers.peers(export).clients == 1
        error = await refused(csi.unpublish(vid, str(target)))
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION and vid in (error.details() or "")
        error = await refused(csi.unstage(vid, str(staging)))
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert (target / SOCKET).exists()
    # The client left: kubelet's retry succeeds, and nothing of the export is left.
    await until(lambda: unix_peers.peers(export).clients == 0, "the client gone from QSD", TIMEOUT_S)
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
    assert not target.exists()
    assert not unix_peers.peers(export).listening


@needs_blkio
async def test_growth_under_a_connected_libblkio_client_is_refused_and_qsd_lives(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    """No back-end channel, no growth: FAILED_PRECONDITION naming the volume and the cure, QSD untouched.

    Before the check, the same call killed QSD (SIGSEGV after "vu_panic:
    Error while writing: Bad file descriptor") and every volume with it.
    Once the client left, the retry grows the volume and the next client
    sees the new size.
    """
    _, csi = driver
    vid, staging, target, export = await published_with_data(box, csi, "vm-blkio-grow")
    before = qsd_pid(box)
    async with connected_client(target):
        assert unix_peers.peers(export).clients == 1
        error = await refused(csi.expand(vid, str(target), 2 * SIZE))
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error.details()
        details = error.details() or ""
        assert vid in details and "back-end channel" in details and "Disconnect that client" in details, details
        assert qsd_pid(box) == before, "qemu-storage-daemon died"
        assert unix_peers.peers(export).clients == 1, "the client was cut off"
    await until(lambda: unix_peers.peers(export).clients == 0, "the client gone from QSD", TIMEOUT_S)
    assert await csi.expand(vid, str(target), 2 * SIZE) == 2 * SIZE
    out = await verified(target, "length", "read -P 0x5a 0 4M", "write -P 0x3c 127M 1M", "read -P 0x3c 127M 1M")
    assert "128 MiB" in out.splitlines(), out
    assert qsd_pid(box) == before
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


async def test_publish_for_a_pod_of_another_group_than_the_stage_is_refused(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    _, csi = driver
    vid = (await csi.create_volume("vm-groups", SIZE, {"export": "vhost-user-blk"})).volume_id
    staging, target = box.staging("vm-groups"), box.target("vm-groups")
    await csi.stage(vid, str(staging), mount_group="3000")
    error = await refused(csi.publish(vid, str(staging), str(target), mount_group="3001"))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    details = error.details() or ""
    assert vid in details and "3000" in details and "3001" in details and "vmmGroup" in details
    assert not target.exists() or not os.listdir(target)
    await csi.publish(vid, str(staging), str(target), mount_group="3000")
    assert owner(target / SOCKET) == (0, 3000, 0o660)
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


async def test_the_pod_connects_through_its_socket_directory_but_cannot_replace_the_socket(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    """Published read-only: root in the pod cannot swap the socket for a link the driver would then chown."""
    _, csi = driver
    vid = (await csi.create_volume("vm-ro-dir", SIZE, {"export": "vhost-user-blk", "vmmGroup": str(VMM)})).volume_id
    staging, target = box.staging("vm-ro-dir"), box.target("vm-ro-dir")
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(target / SOCKET))  # what a VMM does: allowed
        for change in (lambda: os.unlink(target / SOCKET), lambda: os.symlink("/etc/shadow", target / "x"),
                       lambda: os.rename(target / SOCKET, target / "y")):
            with pytest.raises(OSError) as err:
                change()
            assert err.value.errno == errno.EROFS
        assert stat.S_ISSOCK(os.lstat(target / SOCKET).st_mode)
    finally:
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))


async def test_the_access_probe_follows_the_kernels_answer(tmp_path: Path) -> None:
    """check_openable: a group member may connect only with the directory's search and the socket's write bit."""
    published = tmp_path / "volume"
    published.mkdir()
    os.chmod(tmp_path, 0o700)  # the host path above the target is closed: only the target's own bits count
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(published / SOCKET))
        for dir_mode, socket_mode, group, allowed in (
            (0o750, 0o660, 4242, True),
            (0o750, 0o640, 4242, False),  # no write bit for the group: connect() is EACCES
            (0o700, 0o660, 4242, False),  # no search bit on the directory
            (0o750, 0o660, 0, False),  # another group owns it
        ):
            os.chown(published, 0, group)
            os.chmod(published, dir_mode)
            os.chown(published / SOCKET, 0, group)
            os.chmod(published / SOCKET, socket_mode)
            if allowed:
                await vhost_user.check_openable(published, "4242")
            else:
                with pytest.raises(FailedPrecondition, match="group 4242 could not open"):
                    await vhost_user.check_openable(published, "4242")


@needs_blkio
async def test_a_client_connecting_while_the_volume_grows_is_caught_or_kept_out_and_qsd_lives(
    box: Sandbox, driver: tuple[Driver, CSIClient], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race of a VM pod that triggers its own growth: a libblkio client (no back-end channel) connects after
    the driver's first look for clients and before `block_resize`.

    The interleaving is forced, with real parts only: the driver's own check
    (`check_expand`) runs and then, before the call goes on, a real client
    connects and QSD accepts it. Before the fix QSD died in the resize
    (SIGSEGV, every volume of the node with it); now the second look, made
    with the socket hidden, refuses the growth and QSD lives. And while the
    socket is hidden for the resize, a connect() finds no socket at all.
    """
    _, csi = driver
    vid, staging, target, export = await published_with_data(box, csi, "vm-race")
    before = qsd_pid(box)
    first_look = VhostUserExport.check_expand

    async with contextlib.AsyncExitStack() as racer:
        async def then_a_client_connects(self: VhostUserExport, *args: Any) -> None:
            await first_look(self, *args)
            await racer.enter_async_context(connected_client(target))
            assert unix_peers.peers(export).clients == 1

        monkeypatch.setattr(VhostUserExport, "check_expand", then_a_client_connects)
        error = await refused(csi.expand(vid, str(target), 2 * SIZE))
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert vid in (error.details() or "") and "back-end channel" in (error.details() or "")
        assert qsd_pid(box) == before, "qemu-storage-daemon died"
        assert unix_peers.peers(export).clients == 1, "the client was cut off"
    monkeypatch.setattr(VhostUserExport, "check_expand", first_look)
    await until(lambda: unix_peers.peers(export).clients == 0, "the client gone from QSD", TIMEOUT_S)
    assert stat.S_ISSOCK(os.lstat(target / SOCKET).st_mode), "the socket is back where the pod looks"

    real_resize, tried = attach.resize, list[int]()

    async def connect_then_resize(*args: Any) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(str(target / SOCKET))
                tried.append(0)
            except OSError as exc:
                tried.append(exc.errno or -1)
        await real_resize(*args)

    monkeypatch.setattr(attach, "resize", connect_then_resize)
    assert await csi.expand(vid, str(target), 2 * SIZE) == 2 * SIZE
    assert tried == [errno.ENOENT], "a connect() during the resize found the socket"
    assert qsd_pid(box) == before
    out = await verified(target, "length", "read -P 0x5a 0 4M")
    assert "128 MiB" in out.splitlines(), out
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
