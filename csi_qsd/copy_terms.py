"""What both ends of a copy across nodes agree on: the source, the lease, the peers, the settings, the NBD link.

"Copy" is the one word for a volume made from another node's snapshot or
volume, and for everything that makes it. The controller side creates it
(`csi_qsd.controller.copy_targets`) and grants this node's leases to others
(`csi_qsd.controller.copy_sources`); the node side fills it
(`csi_qsd.node.copy_fill`); neither imports the other, so what both use
lives here: the copy's source (`parse_source`), the `CopyLease` a source
grants, the `CopyPeers` a target asks, the node's `CopySettings`, and the
`json:` backing name through which a copy image reads its source
(`nbd_backing`), rewritten in place when the source moves (`point_backing`).
No gRPC, no catalog, no QSD session here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Protocol

from csi_qsd import validate
from csi_qsd.errors import InvalidArgument
from csi_qsd.sys import runtime
from csi_qsd.sys.run import run
from csi_qsd.sys.volume_keys import VolumeKey

# The id of the TLS client credentials object in every QSD of a node that copies from peers.
PEER_TLS_OBJECT = "cqpeer-tls"
# How long the target's reads wait for a lost source to come back before they fail (QEMU's nbd
# reconnect-delay), and how long opening the link may take: both bound what a dead peer costs QSD.
RECONNECT_DELAY_SECONDS = 5
# QSD opens the link (blockdev-add of any image whose chain reaches a copy image) with its monitor silent
# for as long as the open waits: measured on QSD 10.0.13, blockdev-add of an NBD node whose server is
# gone or never greets answers after exactly open-timeout (2.0 s for 2, 10.0 s for 10), and with 0 a
# server that accepts but never greets holds it for good. So the driver first checks that the source
# greets (`csi_qsd.controller.copy_targets.CopyLinkCheck`) and keeps this short, far below the QMP timeout
# (10 s by default), for a source that goes away between the check and the open.
OPEN_TIMEOUT_SECONDS = 2
CHECK_SECONDS = 300  # a key's check of an encrypted lease reads the image's metadata over the link


def parse_source(source: str) -> tuple[str, str]:
    """("snapshot"|"volume", id) of a CreateVolume source; InvalidArgument otherwise."""
    kind, _, ident = source.partition(":")
    if kind == "snapshot" and validate.SNAPSHOT_ID_RE.match(ident):
        return kind, ident
    if kind == "volume" and validate.VOLUME_ID_RE.match(ident):
        return kind, ident
    raise InvalidArgument(f"copy source {source!r} is not snapshot:<id> or volume:<id>")


@dataclasses.dataclass(frozen=True)
class CopyLease:
    """What a source node granted: where its snapshot is served for one copy."""

    node: str
    snapshot_id: str
    address: str  # host:port of its NBD server
    export: str
    size: int
    ttl: float = 0.0  # seconds the source keeps the lease without a renewal (0: for good)
    # The export is the snapshot's image file as it lies on the source's disk (an encrypted volume's: ciphertext,
    # opened here as qcow2 with the volume's key), not the snapshot's data as the source reads it.
    encrypted: bool = False
    # An encrypted snapshot over older layers: where each older layer's image file is served (host:port, the same
    # export name), the next older first. Empty from an earlier version, which served one image.
    older: tuple[str, ...] = ()


class CopyPeers(Protocol):
    """The other nodes' plugins, as the target of a copy reaches them."""

    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> CopyLease:
        """Ask every peer, the one holding `source` serves it; or, for a renewal, `node` alone (the one that
        granted the lease). Raises NotFound, Unavailable, FailedPrecondition (more than one node claims it)."""
        ...

    async def release(self, node: str, copy_volume_id: str) -> None:
        """Drop the lease on `node` ('' : on every peer). Raises Unavailable."""
        ...


@dataclasses.dataclass(frozen=True)
class CopySettings:
    """Where this node serves leased snapshots, and with which TLS files (None: not at all)."""

    state_dir: Path
    host: str = "127.0.0.1"
    ports: range = range(10900, 11000)
    tls: tuple[Path, Path, Path] | None = None  # cert, key, CA
    qemu_nbd: str = "qemu-nbd"
    qemu_img: str = "qemu-img"
    rate: int = 0  # bytes/s a stream may copy (0: as fast as it goes)
    lease_ttl: float = 0.0  # seconds a lease this node serves lasts unless its copy renews it (0: for good)
    # Where QEMU's copies of the TLS files live while it loads them, and only then (tmpfs: `csi_qsd.sys.runtime`).
    runtime_dir: Path = runtime.DEFAULT_RUNTIME_DIR
    leases_per_node: int = 0  # leases one other node may hold here at once (0: half of the ports, at least one)

    @property
    def lease_limit(self) -> int:
        """The most leases one node may hold here: --copy-leases-per-node, else half of --copy-ports."""
        return self.leases_per_node or max(1, len(self.ports) // 2)

    @property
    def copies_dir(self) -> Path:
        return self.state_dir / "copies"


def backing_format(encrypted: bool) -> str:
    """The format of a copy image's backing: the snapshot's data (raw), or an encrypted snapshot's image (qcow2)."""
    return "qcow2" if encrypted else "raw"


def nbd_backing(address: str, export: str, node: str, *, encrypted: bool = False, older: tuple[str, ...] = ()) -> str:
    """The `json:` backing file name of a copy image: the source's export, over TLS, bounded waits.

    The source's certificate must name `node`, the source node (as its DNS name). An `encrypted` export is
    the snapshot's image file: its LUKS layer is opened here (`csi_qsd.qsd.encryption` adds the key), and
    its `older` layers (each served at its own address) are its `backing`, nested, newest first.
    """
    spec: dict[str, object] | None = None
    for at in reversed((address, *older)):
        layer = _nbd_layer(at, export, node, encrypted)
        if spec is not None:
            layer["backing"] = spec
        spec = layer
    return "json:" + json.dumps(spec, separators=(",", ":"))


def _nbd_layer(address: str, export: str, node: str, encrypted: bool) -> dict[str, object]:
    host, _, port = address.rpartition(":")
    return {"driver": backing_format(encrypted), "file": {
        "driver": "nbd", "server": {"type": "inet", "host": host.strip("[]"), "port": port}, "export": export,
        "tls-creds": PEER_TLS_OBJECT, "tls-hostname": node,
        "reconnect-delay": RECONNECT_DELAY_SECONDS, "open-timeout": OPEN_TIMEOUT_SECONDS}}


async def point_backing(qemu_img: str, image: Path, address: str, export: str, node: str, *,
                        key: VolumeKey | None = None, older: tuple[str, ...] = ()) -> None:
    """Make a copy image (open nowhere) read through the source's export at a new `address`.

    Only the header's backing name changes (`qemu-img rebase -u`, which opens no backing); the copied data stays.
    An encrypted copy image (`key`) opens only with its key, which qemu-img reads from its stdin.
    Raises HostCommandError.
    """
    name = nbd_backing(address, export, node, encrypted=key is not None, older=older)
    if key is None:
        await run(qemu_img, "rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", name, str(image))
        return
    opts = f"driver=qcow2,encrypt.key-secret=key,file.driver=file,file.filename={str(image).replace(',', ',,')}"
    await run(qemu_img, "rebase", "-u", "--object", "secret,id=key,file=/dev/stdin,format=base64", "--image-opts",
              "-F", "qcow2", "-b", name, opts, stdin=key.base64().encode())


async def lease_opens_with(qemu_img: str, lease: CopyLease, tls_dir: Path, key: VolumeKey) -> bool:
    """Whether `key` unlocks the encrypted snapshot image `lease` serves: `qemu-img check` of it over the lease's
    NBD link (TLS files in `tls_dir`, QEMU's names), which reads its LUKS header. Exit code 1 is an open refused
    (0, 2 and 3 report on an image it opened). The key goes on qemu-img's stdin only."""
    spec = json.loads(nbd_backing(lease.address, lease.export, lease.node, encrypted=True)[5:])
    spec.update({"encrypt.key-secret": "key", "backing": None})
    code, _ = await run(qemu_img, "check", "-q", "--object", "secret,id=key,file=/dev/stdin,format=base64",
                        "--object", f"tls-creds-x509,id={PEER_TLS_OBJECT},dir={tls_dir},endpoint=client",
                        "json:" + json.dumps(spec), timeout=CHECK_SECONDS, check=False, stdin=key.base64().encode())
    return code != 1
