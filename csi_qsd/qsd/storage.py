"""What a volume's bytes are, as QSD opens them: the protocol node under its format node.

A pool turns its opaque storage reference into one of these; only this
module (with graph.py) knows the QMP that opens it. A new pool kind adds
its class here: `ImageFile` for the file pool, `ExtentOnDevice` (a raw
window, offset/size, on a whole device) for device pools, whose device is
a `HostDevice` (a kernel block device, one node per volume) or an
`NvmeNamespace` (QEMU's userspace NVMe driver over VFIO, one shared node)
or a `RemoteDevice` (an iSCSI LUN or NBD export through QEMU's own drivers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

from csi_qsd.params import VolumeParameters
from csi_qsd.pool_specs.remote_spec import OnError, RemoteTarget, Scheme
from csi_qsd.qsd import graph
from csi_qsd.qsd.graph import QMPArgs


class Storage(Protocol):
    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        """`blockdev-add` arguments of the protocol node named `nodes.file`."""
        ...

    def max_size(self) -> int | None:
        """The most bytes the volume can grow to where it is (None: as much as the pool has)."""
        ...

    def inline_child(self, params: VolumeParameters, *, read_only: bool) -> QMPArgs | None:
        """The protocol node as an unnamed child of a fresh format node (closed with it), or None if it must be
        a node of its own, addressed by name later."""
        ...


@dataclasses.dataclass(frozen=True)
class ImageFile:
    """An image file on a local filesystem (the file pool)."""

    path: Path
    aio: str = "threads"  # how QSD reads and writes it (`csi_qsd.qsd.file_aio`)
    direct: bool = False  # O_DIRECT, past the host's page cache

    def protocol_blockdev(self, nodes: graph.VolumeNodes, params: VolumeParameters, *, read_only: bool) -> QMPArgs:
        return graph.file_blockdev(nodes, self.path, params, read_only=read_only, aio=self.aio, direct=self.direct)

    def max_size(self) -> int | None:
        return None

    def inline_child(self, params: VolumeParameters, *, read_only: bool) -> QMPArgs | None:
        """Nothing addresses an image file's node by name (it grows through its format node)."""
        return graph.file_blockdev(None, self.path, params, read_only=read_only, aio=self.aio, direct=self.direct)


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


# How long a request waits for an NBD server that went away before it fails, with on-error=fail: well
# inside the QMP timeout, since QSD 10.0 serves FUSE exports in its main loop, which waits with the request.
FAIL_AFTER_SECONDS = 5
# iSCSI has no such bound: QEMU's driver retries a command that timed out 8 times with a growing pause,
# so with libiscsi's shortest timeout (1 s) a write to a target that had gone failed after 45 s (QEMU 11.1.3).
ISCSI_TIMEOUT_SECONDS = 1
# on-error=wait: an NBD client waits this long for its server to come back (QEMU's limit, about 136 years).
WAIT_FOREVER_SECONDS = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class RemoteDevice:
    """A remote target opened by QEMU's own driver (libiscsi, or the NBD client), carved like a device pool.

    Like `HostDevice`, each volume's window gets its own unnamed node (its
    own iSCSI session or NBD connection: a shared node would make a
    writable FUSE export's RESIZE permission conflict with its neighbours);
    the pool's own named node (`base_blockdev`) serves its label, foreign
    data probe and scrubs. Credentials reach QSD as objects that name
    files (`objects`), never as values on the wire or in a log.
    """

    target: RemoteTarget
    node_name: str
    on_error: OnError = OnError.WAIT
    user: str = ""
    password_file: Path | None = None
    tls_dir: Path | None = None
    tls_name: str = ""

    @property
    def secret_id(self) -> str:
        return f"{self.node_name}-pw"

    @property
    def tls_id(self) -> str:
        return f"{self.node_name}-tls"

    def objects(self) -> list[QMPArgs]:
        """The `object-add` arguments QSD needs before any node of the pool: CHAP password, x509 credentials."""
        found: list[QMPArgs] = []
        if self.password_file is not None:
            found.append({"qom-type": "secret", "id": self.secret_id, "file": str(self.password_file),
                          "format": "raw"})
        if self.tls_dir is not None:
            found.append({"qom-type": "tls-creds-x509", "id": self.tls_id, "dir": str(self.tls_dir),
                          "endpoint": "client", "verify-peer": True})
        return found

    def _options(self) -> QMPArgs:
        target = self.target
        fail = self.on_error is OnError.FAIL
        if target.scheme is Scheme.ISCSI:
            options: QMPArgs = {"driver": "iscsi", "transport": "tcp", "portal": f"{target.host}:{target.port}",
                                "target": target.iqn, "lun": target.lun,
                                "timeout": ISCSI_TIMEOUT_SECONDS if fail else 0}
            if self.user:
                options["user"] = self.user
            if self.password_file is not None:
                options["password-secret"] = self.secret_id
        else:
            server: QMPArgs = ({"type": "unix", "path": str(target.socket)} if target.scheme is Scheme.NBD_UNIX
                               else {"type": "inet", "host": target.host, "port": str(target.port)})
            options = {"driver": "nbd", "server": server, "export": target.export,
                       "reconnect-delay": FAIL_AFTER_SECONDS if fail else WAIT_FOREVER_SECONDS}
            if self.tls_dir is not None:
                options["tls-creds"] = self.tls_id
            if self.tls_name:
                options["tls-hostname"] = self.tls_name
        options.update({"cache": {"direct": True, "no-flush": False}, "discard": "unmap"})
        return options

    def base_blockdev(self) -> QMPArgs:
        """`blockdev-add` of the pool's own node: its label, probe and scrubs go through it."""
        return {**self._options(), "node-name": self.node_name}

    def child(self, *, read_only: bool) -> QMPArgs:
        """An unnamed node of the target for one volume's window: its own session or connection."""
        return {**self._options(), "read-only": read_only}


WholeDevice = HostDevice | NvmeNamespace | RemoteDevice


@dataclasses.dataclass(frozen=True)
class ExtentOnDevice:
    """A raw window of `size` bytes at `offset` on a whole device: one volume of a device pool."""

    device: WholeDevice
    offset: int
    size: int

    def max_size(self) -> int | None:
        return self.size

    def inline_child(self, params: VolumeParameters, *, read_only: bool) -> QMPArgs | None:
        """None: the window is reopened by name with another size when the volume grows (`attach.reopen_window`)."""
        return None

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
