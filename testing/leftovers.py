"""What a driver under test may have left on the host and in its QSD: mounts, loop devices, exports, nodes.

Asked of the real system (the mount table, the loop devices' backing files,
QSD over its QMP socket), so a test that requires "nothing left" cannot be
fooled by the driver's own records.
"""

from __future__ import annotations

from pathlib import Path

from csi_qsd.config import Config
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.daemon import qmp_socket, running_pid
from csi_qsd.sys import loop, mounts


def host_leftovers(root: Path) -> list[str]:
    """Mounts below `root` (FUSE exports included) and loop devices over files below it."""
    left = [f"mount {e.mount_point} ({e.fs_type})" for e in mounts.mount_table() if root in e.mount_point.parents]
    left += [f"loop device {lp.device} over {lp.backing_file}" for lp in loop.loop_devices()
             if root in lp.backing_file.parents]
    return left


async def qsd_leftovers(state_dir: Path, *, quit_after: bool = False) -> tuple[dict[str, object], set[str]]:
    """Exports and block nodes the QSD of `state_dir` still holds (none if it does not run)."""
    config = Config(state_dir=state_dir)
    if running_pid(config) is None:
        return {}, set()
    client = QSDClient("leftover-check", 30)
    await client.connect(qmp_socket(config))
    try:
        exports: dict[str, object] = dict(await client.exports())
        nodes = set(await client.node_names())
        if quit_after:
            await client.quit()
    finally:
        await client.disconnect()
    return exports, nodes
