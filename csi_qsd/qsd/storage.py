"""What a volume's bytes are, as QSD opens them: the protocol node under its format node.

A pool turns its opaque storage reference into one of these; only this
module (with graph.py) knows the QMP that opens it. A new pool kind adds
its class here: `ImageFile` for the file pool, `ExtentOnDevice` (a raw
window, offset/size, on a whole device) for device pools, whose device is
a `HostDevice` (a kernel block device, one node per volume) or an
`NvmeNamespace` (QEMU's userspace NVMe driver over VFIO, one shared node).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import graph
from csi_qsd.qsd.graph import QMPArgs


class Storage(Protocol):
    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        """`blockdev-add` arguments of the protocol node named `nodes.file`."""
        ...

    def max_size(self) -> int | None:
        """The most bytes the volume can grow to where it is (None: as much as the pool has)."""
        ...


@dataclasses.dataclass(frozen=True)
class ImageFile:
    """An image file on a local filesystem (the file pool)."""

    path: Path

    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        return graph.file_blockdev(nodes, self.path, params, read_only=read_only)

    def max_size(self) -> int | None:
        return None


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """A whole block device that the volumes of a device pool are carved from."""

    path: Path
    aio: str = "native"

    def child(self, *, read_only: bool) -> QMPArgs:
        """An unnamed `host_device` child for one volume's extent node.

        One per volume rather than one shared node: a writable FUSE export
        takes the RESIZE permission down its whole chain, while a `raw` node
        with offset/size refuses to share RESIZE on its child, so two such
        volumes on one shared node conflict (QSD 10.0.13 refuses the second
        blockdev-add). Separate nodes each hold their own O_DIRECT descriptor;
        QEMU's image locking is off on them because the extents, not locks,
        keep volumes apart (the locks would see the same conflict).
        """
        return {
            "driver": "host_device",
            "filename": str(self.path),
            "cache": {"direct": True, "no-flush": False},
            "aio": self.aio,
            "discard": "unmap",
            "locking": "off",
            "read-only": read_only,
        }


@dataclasses.dataclass(frozen=True)
class NvmeNamespace:
    """A namespace of a PCI NVMe controller driven by QSD itself over VFIO (the device bound to vfio-pci).

    VFIO gives the controller to one process once, so the namespace is one
    named node that every volume's window shares, added when the pool opens
    (`base_blockdev`). On a shared node only exports that take no RESIZE
    permission can coexist: a writable FUSE export takes RESIZE down its
    chain and a `raw` window shares none, so QSD 10.0.13 refuses the second
    window ("Permission conflict on node ...: permissions 'resize' are both
    required by node ... and unshared by node ..."). The pool therefore
    serves VM volumes (vhost-user-blk) only.
    """

    pci: str
    namespace: int
    node_name: str

    def base_blockdev(self) -> QMPArgs:
        """`blockdev-add` of the namespace: QEMU's userspace NVMe driver (polled queues, no kernel driver)."""
        return {"driver": "nvme", "node-name": self.node_name, "device": self.pci, "namespace": self.namespace,
                "discard": "unmap"}

    def child(self, *, read_only: bool) -> str:
        """The shared node, by name: read-only windows need no read-only node under them."""
        return self.node_name


WholeDevice = HostDevice | NvmeNamespace


@dataclasses.dataclass(frozen=True)
class ExtentOnDevice:
    """A raw window of `size` bytes at `offset` on a whole device: one volume of a device pool."""

    device: WholeDevice
    offset: int
    size: int

    def max_size(self) -> int | None:
        return self.size

    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        # QEMU's raw driver bounds every request to [offset, offset+size): a consumer cannot reach a neighbour.
        return {
            "driver": "raw",
            "node-name": nodes.file,
            "file": self.device.child(read_only=read_only),
            "offset": self.offset,
            "size": self.size,
            "discard": params.discard.value,
            "read-only": read_only,
        }
