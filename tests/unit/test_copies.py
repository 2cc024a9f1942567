"""Copies across nodes: what the target writes into a copy image's header, sources, ports, and the catalog rows."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from csi_qsd.catalog import Catalog, CopyRecord, CopyRole, CopyState
from csi_qsd.cli import build_parser
from csi_qsd.controller.copies import PEER_TLS_OBJECT, nbd_backing, parse_source
from csi_qsd.errors import InvalidArgument
from csi_qsd.node.copies import names_backing
from csi_qsd.qcow2 import blank, layer_bitmaps
from csi_qsd.sys import nbd_tcp


def test_the_backing_names_the_export_over_tls_with_bounded_waits() -> None:
    name = nbd_backing("10.0.0.7:10901", "vol-0123456789abcdef01234567", "csi-qsd-node")
    assert name.startswith("json:")
    spec = json.loads(name[5:])
    nbd = spec["file"]
    assert spec["driver"] == "raw" and nbd["driver"] == "nbd"
    assert nbd["server"] == {"type": "inet", "host": "10.0.0.7", "port": "10901"}
    assert nbd["tls-creds"] == PEER_TLS_OBJECT and nbd["tls-hostname"] == "csi-qsd-node"
    assert nbd["reconnect-delay"] > 0 and nbd["open-timeout"] > 0
    assert json.loads(nbd_backing("[fd00::1]:10901", "e", "n")[5:])["file"]["server"]["host"] == "fd00::1"


def test_sources() -> None:
    assert parse_source("snapshot:snap-0123456789abcdef01234567") == ("snapshot", "snap-0123456789abcdef01234567")
    assert parse_source("volume:vol-0123456789abcdef01234567") == ("volume", "vol-0123456789abcdef01234567")
    for bad in ("snapshot:../x", "volume:snap-0123456789abcdef01234567", "disk:vol-0123456789abcdef01234567", ""):
        with pytest.raises(InvalidArgument):
            parse_source(bad)


def test_a_copy_image_names_its_backing_until_it_stands_alone(tmp_path: Path) -> None:
    image = tmp_path / "c.qcow2"
    with open(image, "wb") as f:
        blank.write(f.fileno(), blank.image_bytes(1 << 26, 1 << 16, layer_bitmaps.OWN,
                                                  backing=nbd_backing("127.0.0.1:1", "e", "n"), backing_format="raw"))
    assert names_backing(image)
    alone = tmp_path / "alone.qcow2"
    with open(alone, "wb") as f:
        blank.write(f.fileno(), blank.image_bytes(1 << 26, 1 << 16, layer_bitmaps.OWN))
    assert not names_backing(alone)


def test_ports_in_use_are_skipped() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert not nbd_tcp.port_free("127.0.0.1", port)
        assert nbd_tcp.pick_port("127.0.0.1", range(port, port + 1), set()) is None
    assert nbd_tcp.pick_port("127.0.0.1", range(port, port + 1), {port}) is None


def test_flags() -> None:
    args = build_parser().parse_args(["serve", "--peer", "node-a=10.0.0.1:9811", "--copy-ports", "20000-20009",
                                      "--copy-rate", "64Mi"])
    assert args.copy_ports == range(20000, 20010) and args.copy_rate == 64 << 20
    assert [(p.name, p.address) for p in args.peer] == [("node-a", "10.0.0.1:9811")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--copy-ports", "9-1"])


async def test_copy_rows_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    record = CopyRecord(volume_id="vol-0123456789abcdef01234567", role=CopyRole.SOURCE, node="node-b",
                        source="snapshot:snap-0123456789abcdef01234567", state=CopyState.SERVING, created_at=1.5,
                        snapshot_id="snap-0123456789abcdef01234567", address="127.0.0.1:10900", image="/p/i.qcow2")
    async with Catalog(path) as catalog:
        await catalog.put_copy(record)
        assert await catalog.copy(record.volume_id, CopyRole.TARGET) is None
    async with Catalog(path) as catalog:
        assert await catalog.copy(record.volume_id, CopyRole.SOURCE) == record
        assert await catalog.copies(CopyRole.SOURCE) == [record]
        await catalog.delete_copy(record.volume_id, CopyRole.SOURCE)
        assert await catalog.copies(CopyRole.SOURCE) == []
