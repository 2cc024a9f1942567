"""Disk kinds a guest can be given, and the QEMU arguments for each.

Both kinds appear in the guest as virtio-blk PCI disks (``/dev/vdX`` in
command-line order), so the same guest scripts and kernel modules serve both;
only the host side differs:

* :class:`VhostUserDisk`: the block device lives in another process (here
  qemu-storage-daemon, as the CSI driver serves VM volumes) behind a
  vhost-user-blk unix socket. Guest RAM must be shareable (memfd,
  ``share=on``) so the backend can DMA into it, which :mod:`.vm` arranges.
* :class:`FileDisk`: QEMU's own in-process virtio-blk on an image file, the
  baseline a benchmark compares vhost-user-blk against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


def _escape(value: str) -> str:
    # QEMU option values use ',' as separator; a literal comma is written ',,'.
    return value.replace(",", ",,")


def _onoff(value: bool) -> str:
    return "on" if value else "off"


@dataclass(frozen=True)
class VhostUserDisk:
    """A vhost-user-blk backend listening on ``socket_path``.

    ``config_wce=None`` keeps QEMU's default (``config-wce=on``: the guest
    reads the cache mode from the backend, which QSD 7.2 reports as
    write-through, so it never sends a flush); ``False`` (``config-wce=off``)
    makes the guest see a write-back cache and flush on fsync. Measured:
    ``/sys/block/vda/queue/write_cache`` reads "write through" and "write
    back" respectively. ``reconnect_s`` lets QEMU re-attach if the backend restarts,
    which is what a VM on a live-upgraded storage daemon relies on.
    """

    socket_path: Path
    num_queues: int = 1
    config_wce: bool | None = None
    reconnect_s: int = 1

    def qemu_args(self, index: int) -> list[str]:
        chardev = f"char{index}"
        sock = f"socket,id={chardev},path={_escape(str(self.socket_path))}"
        if self.reconnect_s > 0:
            sock += f",reconnect={self.reconnect_s}"
        device = f"vhost-user-blk-pci,id=disk{index},chardev={chardev},num-queues={self.num_queues}"
        if self.config_wce is not None:
            device += f",config-wce={_onoff(self.config_wce)}"
        return ["-chardev", sock, "-device", device]


@dataclass(frozen=True)
class FileDisk:
    """An image file served by QEMU's built-in virtio-blk.

    Defaults mirror what a performance-minded VM would use (O_DIRECT via
    ``cache=none``, Linux native AIO); ``iothread=True`` moves the disk's I/O
    off QEMU's main loop, as production setups do.
    """

    path: Path
    format: Literal["qcow2", "raw"] = "qcow2"
    cache: Literal["none", "writeback", "writethrough", "directsync", "unsafe"] = "none"
    aio: Literal["native", "threads", "io_uring"] = "native"
    num_queues: int | None = None
    iothread: bool = False

    def qemu_args(self, index: int) -> list[str]:
        drive = (
            f"file={_escape(str(self.path))},if=none,id=drive{index},"
            f"format={self.format},cache={self.cache},aio={self.aio}"
        )
        device = f"virtio-blk-pci,id=disk{index},drive=drive{index}"
        if self.num_queues is not None:
            device += f",num-queues={self.num_queues}"
        args = ["-drive", drive]
        if self.iothread:
            args += ["-object", f"iothread,id=io{index}"]
            device += f",iothread=io{index}"
        return args + ["-device", device]


Disk = VhostUserDisk | FileDisk
