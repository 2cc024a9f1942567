"""vhost-user-blk volumes: a per-volume socket directory bind-mounted into the pod.

A directory, not the socket file, is published, so a QSD restart that makes
the socket anew is seen through the same mount. Only root and one group (the
StorageClass's `vmmGroup`, else the pod's VOLUME_MOUNT_GROUP) may open the
socket; a publish proves that a process of that group can, as the kernel
decides it, before the pod gets the socket.

The socket directory is the pod's to see, never to change: root in the pod
could otherwise swap the socket for a symbolic link between QSD's bind and
the driver's chown/chmod, which follow links, and have the driver hand a
host file of its choosing to the VMM's group. So the directory is published
read-only (a UNIX socket's `connect()` works through a read-only mount;
nothing in it can be removed or replaced from the pod), and the socket and
its directory are changed only through a descriptor opened without
following links and checked to be a socket (a directory), never by name.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path

from csi_qsd.errors import AlreadyExists, FailedPrecondition
from csi_qsd.sys import mounts
from csi_qsd.sys.run import tool_env

SOCKET_NAME = "vhost-user-blk.sock"
# Where the socket is while the volume grows: beside the socket directory, out of the pod's sight.
HIDDEN_NAME = "vhost-user-blk.resizing.sock"
# Who the access probe runs as: the overflow user, neither root nor the socket's owner, so only the
# group's permission bits can let it in.
PROBE_UID = 65534
PROBE_TIMEOUT_S = 10.0


def prepare_dir(socket_dir: Path, group: str) -> None:
    """Make the socket directory, root's and `group`'s only. Raises FailedPrecondition if it is not a directory."""
    socket_dir.mkdir(parents=True, exist_ok=True)
    _restrict(socket_dir, stat.S_ISDIR, "a directory", 0 if not group else int(group), 0o750 if group else 0o700)


def restrict_socket(socket: Path, group: str) -> None:
    """Give QSD's socket to root and `group`. Raises FailedPrecondition, changing nothing, if what is at `socket`
    is not a socket (a symbolic link put there in place of QSD's, say)."""
    _restrict(socket, stat.S_ISSOCK, "a socket", int(group) if group else 0, 0o660 if group else 0o600)


def hide(socket_dir: Path) -> None:
    """Move QSD's socket out of the directory the pod sees (to HIDDEN_NAME beside it), so nothing can connect
    to it, whatever its privileges: a connect() finds no name. QSD keeps listening, and its clients stay
    connected. Raises FileNotFoundError if there is no socket."""
    os.rename(socket_dir / SOCKET_NAME, socket_dir.parent / HIDDEN_NAME)


def unhide(socket_dir: Path) -> None:
    """Put a socket `hide` moved back (after a crash in between too); a socket QSD made again in its place
    since is kept, and the moved one removed. Nothing if none was moved."""
    hidden = socket_dir.parent / HIDDEN_NAME
    if not os.path.lexists(hidden):
        return
    if os.path.lexists(socket_dir / SOCKET_NAME):
        hidden.unlink()
    else:
        os.rename(hidden, socket_dir / SOCKET_NAME)


def _restrict(path: Path, is_kind: Callable[[int], bool], kind: str, gid: int, mode: int) -> None:
    """chown root:`gid` and chmod `mode` the very inode at `path`, only if `is_kind` of its mode: through an
    O_PATH descriptor opened without following a link (the kernel resolves /proc/self/fd/N to that inode)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        found = os.fstat(fd).st_mode
        if not is_kind(found):
            raise FailedPrecondition(
                f"{path} is {stat.filemode(found)}, not {kind}: something replaced what qemu-storage-daemon made "
                "there (from inside the pod the volume is published to?); its owner and mode were left alone. "
                "Unpublish and unstage the volume, then stage it again")
        os.chown(f"/proc/self/fd/{fd}", 0, gid)
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)


async def ensure_published(socket_dir: Path, target: Path) -> None:
    _require_parent(target)
    target.mkdir(mode=0o750, exist_ok=True)
    entry = mounts.mounted_at(target)
    if entry is not None:
        if not entry.root.endswith(str(socket_dir)) and entry.root != str(socket_dir):
            raise AlreadyExists(f"target {target} already has another mount")
        return
    await mounts.bind(socket_dir, target, readonly=True, options=[])  # connect() works; replacing the socket not


async def unpublish(target: Path) -> None:
    await mounts.unmount(target)
    if target.is_dir():
        try:
            target.rmdir()
        except OSError:
            pass


async def check_openable(target: Path, group: str) -> None:
    """Prove that a process whose only group is `group` may connect to the socket published at `target`.

    The probe runs `test -S -w` as PROBE_UID with that one group, from inside
    the target directory (entered as root), so the kernel checks what a VMM
    in the VM's pod meets: the published directory's search bit and the
    socket's write bit, not the host path above the mount. `setpriv` drops
    the identity: a child forked from this process (gRPC's threads) that
    changed its own ids before exec died of SIGSEGV. Raises
    FailedPrecondition naming the socket's owner, group and mode.
    """
    socket = target / SOCKET_NAME
    proc = await asyncio.create_subprocess_exec(
        "setpriv", f"--reuid={PROBE_UID}", f"--regid={int(group)}", "--clear-groups", "--",
        "test", "-S", SOCKET_NAME, "-a", "-w", SOCKET_NAME,
        cwd=target, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, env=tool_env(),
    )
    try:
        code = await asyncio.wait_for(proc.wait(), PROBE_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if code != 0:
        raise FailedPrecondition(
            f"a VMM in group {group} could not open the vhost-user-blk socket at {socket} "
            f"({_describe(target)}, {_describe(socket)}); a VM would wait on it for ever: check the group "
            "(the StorageClass parameter vmmGroup, else the pod's fsGroup) and what restricts the mount"
        )


def _describe(path: Path) -> str:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path.name or path}: {exc.strerror}"
    return f"{path.name} {stat.filemode(st.st_mode)} {st.st_uid}:{st.st_gid}"


def _require_parent(target: Path) -> None:
    if not target.parent.is_dir():
        raise FailedPrecondition(f"the parent directory of target {target} does not exist; the CO creates it")
