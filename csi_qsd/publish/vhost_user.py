"""vhost-user-blk volumes: a per-volume socket directory bind-mounted into the pod.

A directory, not the socket file, is published, so a QSD restart that makes
the socket anew is seen through the same mount. Only root and the pod's group
(VOLUME_MOUNT_GROUP) may open the socket.
"""

from __future__ import annotations

import os
from pathlib import Path

from csi_qsd.errors import AlreadyExists, FailedPrecondition
from csi_qsd.sys import mounts

SOCKET_NAME = "vhost-user-blk.sock"


def prepare_dir(socket_dir: Path, group: str) -> None:
    socket_dir.mkdir(parents=True, exist_ok=True)
    gid = int(group) if group else 0
    os.chown(socket_dir, 0, gid)
    os.chmod(socket_dir, 0o750 if group else 0o700)


def restrict_socket(socket: Path, group: str) -> None:
    gid = int(group) if group else 0
    os.chown(socket, 0, gid)
    os.chmod(socket, 0o660 if group else 0o600)


async def ensure_published(socket_dir: Path, target: Path) -> None:
    _require_parent(target)
    target.mkdir(mode=0o750, exist_ok=True)
    entry = mounts.mounted_at(target)
    if entry is not None:
        if not entry.root.endswith(str(socket_dir)) and entry.root != str(socket_dir):
            raise AlreadyExists(f"target {target} already has another mount")
        return
    await mounts.bind(socket_dir, target, readonly=False, options=[])


async def unpublish(target: Path) -> None:
    await mounts.unmount(target)
    if target.is_dir():
        try:
            target.rmdir()
        except OSError:
            pass


def _require_parent(target: Path) -> None:
    if not target.parent.is_dir():
        raise FailedPrecondition(f"the parent directory of target {target} does not exist; the CO creates it")
