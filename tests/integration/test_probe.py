"""A device that cannot be read is never taken for an empty one (which staging would format).

blkid answers "nothing found" (exit 2) for a direct-I/O loop device over a
FUSE export whose QSD died, though every read fails with EIO.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from csi_qsd.errors import Unavailable
from csi_qsd.sys import filesystems, loop
from testing.harness import Sandbox, until

MIB = 1 << 20


async def test_a_loop_device_over_a_dead_fuse_export_is_unavailable_not_empty(box: Sandbox) -> None:
    image, export, monitor = box.root / "disk.raw", box.root / "export", box.root / "qmp.sock"
    image.write_bytes(b"")
    os.truncate(image, 16 * MIB)
    export.touch()
    qsd = subprocess.Popen([
        "qemu-storage-daemon",
        "--blockdev", f"driver=file,node-name=disk,filename={image}",
        "--export", f"type=fuse,id=exp,node-name=disk,mountpoint={export},writable=on",
        "--chardev", f"socket,id=m,path={monitor},server=on,wait=off", "--monitor", "chardev=m",
    ])
    device = None
    try:
        await until(lambda: os.path.ismount(export), "the FUSE export to be mounted", 30)
        device = await loop.attach(export, direct_io=True)  # as on QSD >= 10.0.8: reads go to the export
        assert await filesystems.probe(device) == ""  # readable and blank: empty
        qsd.send_signal(signal.SIGKILL)
        qsd.wait(30)
        with pytest.raises(Unavailable, match="cannot be read|read 0 of"):
            await filesystems.probe(device)
    finally:
        if qsd.poll() is None:
            qsd.kill()
            qsd.wait(30)
        if device is not None:
            await loop.detach(device)
        await asyncio.to_thread(subprocess.run, ["umount", "-l", str(export)], capture_output=True, check=False)
