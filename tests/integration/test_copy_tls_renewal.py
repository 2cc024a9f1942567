"""A renewed node certificate reaches QSD's TLS client object for copies (`cqpeer-tls`) without a restart.

QEMU reads a `tls-creds-x509` object's files once. The node's files are
replaced in place (kubelet swapping a renewed Secret); the next copy loads
them again (`CopyFill.prepare`), and the NBD link it opens presents the
renewed certificate. Here the source (a real qemu-nbd, as a copy's source
serves it) trusts only the new CA, so the link goes from refused to open;
before the reload existed, QSD kept presenting the old certificate.
Renewed files QEMU refuses (a key that is not the certificate's) leave the
loaded object as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, cast

from csi_qsd.catalog import Catalog
from csi_qsd.cli.client import CSIClient
from csi_qsd.copy_terms import PEER_TLS_OBJECT, CopyPeers, CopySettings, nbd_backing
from csi_qsd.errors import QSDError
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.node.copy_fill import CopyFill
from csi_qsd.qsd.client import QSDClient
from csi_qsd.server import Driver
from csi_qsd.sys import nbd_tcp
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.sys.tools import bundled
from testing.certs import Authority, mint
from testing.harness import free_port

MIB = 1 << 20


def _link(address: str, node_name: str) -> dict[str, Any]:
    """The NBD node a copy image's backing file opens (the copy's own spec), as a node of its own."""
    spec = json.loads(nbd_backing(address, "copy", "node-a").removeprefix("json:"))
    return {**spec["file"], "node-name": node_name, "read-only": True}


async def _opens(client: QSDClient, address: str, node_name: str) -> bool:
    try:
        await client.execute("blockdev-add", _link(address, node_name))
    except QSDError:
        return False
    await client.execute("blockdev-del", {"node-name": node_name})
    return True


async def _objects(client: QSDClient) -> set[str]:
    return {str(item["name"]) for item in await client.execute("qom-list", {"path": "/objects"})}


def _swap(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    os.utime(target, (time.time() + 5,) * 2)


async def test_the_next_copy_presents_the_renewed_certificate(
        driver: tuple[Driver, CSIClient], tmp_path: Path) -> None:
    drv, _ = driver
    client = drv.daemon.client
    (tmp_path / "old").mkdir()
    old_ca, new = Authority(tmp_path / "old", "cluster-old"), mint(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    cert, key, ca = live / "tls.crt", live / "tls.key", live / "ca.crt"
    b_old, b_new = old_ca.issue("node-b", server=True, dns_names=("node-b",)), new.for_node("node-b")
    shutil.copyfile(b_old.cert, cert)
    shutil.copyfile(b_old.key, key)
    ca.write_bytes(old_ca.ca_path.read_bytes() + new.cluster.ca_path.read_bytes())  # the CA bundle of a rotation

    image = tmp_path / "source.raw"
    image.write_bytes(b"\x5a" * MIB)
    a = new.for_node("node-a")
    server_tls = nbd_tcp.tls_dir(tmp_path / "server-tls", a.cert, a.key, new.cluster.ca_path, endpoint="server")
    port, pid_file = free_port(), tmp_path / "nbd.pid"
    address = f"127.0.0.1:{port}"
    await nbd_tcp.start(bundled("qemu-nbd"), str(image), host="127.0.0.1", port=port, export="copy",
                        tls=server_tls, pid_file=pid_file, admit=nbd_tcp.plain_subject("node-b"))
    streams = CopyFill(cast(Catalog, None), cast(ExportPaths, None), KeyedLocks("volume"), cast(CopyPeers, None),
                          CopySettings(state_dir=tmp_path / "state", tls=(cert, key, ca), runtime_dir=tmp_path / "run"))
    try:
        await streams.prepare(client)
        assert PEER_TLS_OBJECT in await _objects(client)
        assert not await _opens(client, address, "cqtest-link-0"), "the source trusts only the new CA"

        for source_file, target in ((b_new.cert, cert), (b_new.key, key)):
            _swap(source_file, target)
        await streams.prepare(client, required=True)  # what the next copy does before it opens its link
        assert await _opens(client, address, "cqtest-link-1"), "the next copy presents the renewed certificate"

        # Renewed files QEMU refuses (the old key beside the new certificate): the loaded object stays.
        _swap(b_old.key, key)
        await streams.prepare(client, required=True)
        assert await _opens(client, address, "cqtest-link-2")
        objects = await _objects(client)
        assert PEER_TLS_OBJECT in objects and PEER_TLS_OBJECT + "-new" not in objects
        assert list((tmp_path / "run").iterdir()) == [], "QEMU's copies of the files went once it loaded them"
    finally:
        await nbd_tcp.stop(pid_file, port)

