"""An encrypted volume restored onto another node: ciphertext on the wire and in the target's pool, one Secret.

Two `csi-qsd serve` processes are two nodes over mutual TLS, as in
`test_cross_node_copy`. Node A holds an encrypted block volume written with
a known pattern and a snapshot of it; node B makes a volume from that
snapshot with the same Secret. A serves the snapshot's image file as it lies
on its disk, B opens it with the key and streams it into an encrypted copy
image of its own: B reads the pattern back through a stage, and no image of
B's pool holds it. What A's copy server sends (read as B) is that image
file, LUKS header and ciphertext, without the pattern. A missing or wrong key, or a class that is not encrypted, is
refused on B with nothing left: no image, no key, no lease on A.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import grpc
import pytest

from csi_qsd.copy_terms import nbd_backing, point_backing
from csi_qsd.errors import HostCommandError
from csi_qsd.pools.files import FilePool
from csi_qsd.qcow2 import backing
from csi_qsd.sys import nbd_tcp
from csi_qsd.sys.pem import PemFiles
from csi_qsd.sys.run import run
from csi_qsd.sys.tools import bundled
from csi_qsd.sys.volume_keys import VolumeKey
from testing.certs import mint
from testing.harness import free_port, qsd_pids, refused, until
from testing.helpers.ciphertext import holds, luks, marker
from testing.router_cluster import Node
from tests.integration.test_cross_node_copy import (
    _as_the_co,
    _condition,
    _copy_servers,
    _kill,
    _lease_gone,
    _local,
    _node,
    _progress,
    _read,
    _served_port,
    _write,
)

MIB = 1 << 20
SIZE = 32 * MIB
RATE = 4 * MIB  # bytes/s: the copy takes ~8 s, long enough to see the key held while it fills
ENCRYPTED = {"encrypted": "true"}
PROVISIONER = "csi.storage.k8s.io/provisioner-secret-name"


def _pool_images(node: Node) -> list[Path]:
    return sorted((node.box.state_dir / "pool").glob("vol-*"))


def _write_at(device: Path, offset: int, data: bytes) -> None:
    fd = os.open(device, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _held_keys(node: Node) -> list[str]:
    directory = node.box.runtime_dir / "keys"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


async def _source(a: Node, key: str, data: bytes) -> tuple[str, str]:
    """An encrypted block volume on A holding `data`, unstaged, and a snapshot of it (its first layer)."""
    secret = {"key": key}
    vid = (await a.csi.create_volume("source", SIZE, ENCRYPTED, block=True, secrets=secret)).volume_id
    staging, target = a.box.staging(vid), a.box.target(vid)
    await a.csi.stage(vid, str(staging), block=True, secrets=secret)
    await a.csi.publish(vid, str(staging), str(target), block=True)
    await asyncio.to_thread(_write, target, data)
    await a.csi.unpublish(vid, str(target))
    await a.csi.unstage(vid, str(staging))
    return vid, (await a.csi.create_snapshot("snap", vid, secrets=secret)).snapshot_id


async def _later_snapshot(a: Node, vid: str, key: str, data: bytes, second: bytes) -> tuple[str, bytes]:
    """The volume's second half written with `second` over `data`, then a snapshot of it (over the first): its
    ID and the data it holds."""
    secret = {"key": key}
    later = (second * (SIZE // 2 // len(second) + 1))[:SIZE // 2]
    staging, target = a.box.staging(vid), a.box.target(vid)
    await a.csi.stage(vid, str(staging), block=True, secrets=secret)
    await a.csi.publish(vid, str(staging), str(target), block=True)
    await asyncio.to_thread(_write_at, target, SIZE // 2, later)
    await a.csi.unpublish(vid, str(target))
    await a.csi.unstage(vid, str(staging))
    snapshot = (await a.csi.create_snapshot("later", vid, secrets=secret)).snapshot_id
    return snapshot, data[:SIZE // 2] + later


async def _refused_with_nothing_left(a: Node, b: Node, snapshot: str, key: str) -> None:
    """No key, a wrong key, a class that is not encrypted: each refused on B, naming what to fix; nothing stays."""
    await refused(b.csi.create_volume("copy", SIZE, ENCRYPTED, block=True, from_snapshot=snapshot),
                  grpc.StatusCode.INVALID_ARGUMENT, PROVISIONER)
    await refused(b.csi.create_volume("copy", SIZE, ENCRYPTED, block=True, from_snapshot=snapshot,
                                      secrets={"key": key + "x"}),
                  grpc.StatusCode.PERMISSION_DENIED, PROVISIONER, snapshot, "node-a")
    await refused(b.csi.create_volume("plain", SIZE, block=True, from_snapshot=snapshot),
                  grpc.StatusCode.INVALID_ARGUMENT, snapshot, "encrypted=false")
    assert _pool_images(b) == [] and _held_keys(b) == []
    assert not _copy_servers(a.box), "a refused copy gives its lease back at once"


async def _served_bytes(address: str, export: str, files: PemFiles, directory: Path) -> bytes:
    """All A's copy server sends for `export`, read as a copy's node does (its certificate): the bytes on the wire."""
    tls = await asyncio.to_thread(nbd_tcp.tls_dir, directory, files.cert, files.key, files.ca, endpoint="client")
    host, _, port = address.rpartition(":")
    out = directory / "served.bin"
    await run(bundled("qemu-img"), "convert", "-O", "raw", "--object",
              f"tls-creds-x509,id=tls0,dir={tls},endpoint=client", "--image-opts",
              f"driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={host},file.server.port={port},"
              f"file.export={export},file.tls-creds=tls0,file.tls-hostname=node-a", str(out))
    return await asyncio.to_thread(out.read_bytes)


async def test_an_encrypted_snapshot_restored_on_another_node_stays_ciphertext_and_opens_with_its_secret(
        tmp_path: Path) -> None:
    pki = mint(tmp_path / "pki")
    a_address, b_address, low = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    key = secrets.token_urlsafe(32)
    pattern, second = marker(), marker()
    data = (pattern * (SIZE // len(pattern) + 1))[:SIZE]
    async with _node("node-a", pki, a_address, "--copy-ports", f"{low}-{low + 4}", "--peer",
                     f"node-b={b_address}") as a, \
            _node("node-b", pki, b_address, "--peer", f"node-a={a_address}", "--copy-rate", str(RATE)) as b:
        source_vid, snapshot = await _source(a, key, data)
        await _refused_with_nothing_left(a, b, snapshot, key)

        vid = (await b.csi.create_volume("copy", SIZE, ENCRYPTED, block=True, from_snapshot=snapshot,
                                         secrets={"key": key})).volume_id
        message = (await _condition(b, vid)).message
        assert "being copied from node node-a" in message, message
        assert _held_keys(b) == [vid], "B holds the key while the copy fills, for a restart to resume it"
        # What A serves is the snapshot's image file as on A's disk: a qcow2 with a LUKS header, no pattern.
        (server,) = _copy_servers(a.box)
        served = await _served_bytes(f"127.0.0.1:{_served_port(server)}", vid, pki.for_node("node-b"),
                                     tmp_path / "tls-b")
        assert served[:4] == b"QFI\xfb" and b"LUKS\xba\xbe" in served and pattern not in served

        # SIGKILL of B's driver and QSD mid-stream: the restarted driver reopens the chain with the key it held
        # (tmpfs, --runtime-dir) and the copy resumes; no new CreateVolume brings the key again.
        await until(lambda: _progress(b, vid, 5), "the copy under way", 30, interval=0.2)
        b_qsd = qsd_pids(b.box.state_dir)
        await b.process.kill9()
        _kill(b_qsd)
        await b.process.start(timeout=60)
        assert _held_keys(b) == [vid]
        await until(lambda: _local(b, vid), lambda: f"the copy done; node-b log:\n{b.process.log()[-4000:]}", 120,
                    interval=0.5)
        await until(lambda: _held_keys(b) == [], "B's key dropped once the copy is done", 10)

        staging, target = b.box.staging(vid), b.box.target(vid)
        await _as_the_co(lambda: b.csi.stage(vid, str(staging), block=True, secrets={"key": key}))
        await _as_the_co(lambda: b.csi.publish(vid, str(staging), str(target), block=True))
        assert await asyncio.to_thread(_read, target, 0, SIZE) == data
        await b.csi.unpublish(vid, str(target))
        await b.csi.unstage(vid, str(staging))

        await until(lambda: _lease_gone(a, snapshot), "node-a's lease released by node-b", 30, interval=0.5)
        assert not _copy_servers(a.box)

        # A later snapshot over older layers: A serves each layer's image file, B reads them as one chain.
        later, expected = await _later_snapshot(a, source_vid, key, data, second)
        layered = (await b.csi.create_volume("layered", SIZE, ENCRYPTED, block=True, from_snapshot=later,
                                             secrets={"key": key})).volume_id
        assert len(_copy_servers(a.box)) == 2, "one server per layer of the later snapshot's chain"
        await until(lambda: _local(b, layered), lambda: f"the layered copy done; node-b log:\n"
                    f"{b.process.log()[-4000:]}", 120, interval=0.5)
        staging, target = b.box.staging(layered), b.box.target(layered)
        await _as_the_co(lambda: b.csi.stage(layered, str(staging), block=True, secrets={"key": key}))
        await _as_the_co(lambda: b.csi.publish(layered, str(staging), str(target), block=True))
        got = await asyncio.to_thread(_read, target, 0, SIZE)
        assert got[:SIZE // 2] == expected[:SIZE // 2], "blocks only the older layer holds"
        assert got == expected
        await b.csi.unpublish(layered, str(target))
        await b.csi.unstage(layered, str(staging))

        images = _pool_images(b)
        assert len(images) == 4, images  # per copy: the copy image and the volume's top over it
        for image in images:
            assert luks(image), image
            for clear in (pattern, second, key.encode()):
                assert not holds(image, clear), f"{image} holds {clear[:8]!r} in the clear"
            _, info = await run(bundled("qemu-img"), "info", "-U", "--output=json", str(image))
            assert "json:" not in json.loads(info).get("backing-filename", ""), info
        assert key not in a.process.log() and key not in b.process.log()
        await until(lambda: _lease_gone(a, later), "node-a's lease of the later snapshot released", 30, interval=0.5)
        assert not _copy_servers(a.box)


async def test_an_encrypted_copy_image_follows_its_source_to_a_new_address_only_with_its_key(tmp_path: Path) -> None:
    """A source that came back on another port: the copy image's header names the new link (`point_backing`,
    which opens the encrypted image with its key, on qemu-img's stdin); another key changes nothing."""
    pool = FilePool(tmp_path / "pool", bundled("qemu-img"))
    pool.prepare()
    image = tmp_path / "pool" / "vol-0123456789abcdef01234567-copy.qcow2"
    key = VolumeKey(secrets.token_urlsafe(32))
    old = nbd_backing("127.0.0.1:10901", "vol-0123456789abcdef01234567", "node-a", encrypted=True)
    await pool.create_encrypted_copy(image, SIZE, 1 << 16, key, old)
    assert backing.backing_name(image) == old and luks(image)

    new = nbd_backing("127.0.0.1:10902", "vol-0123456789abcdef01234567", "node-a", encrypted=True)
    with pytest.raises(HostCommandError):
        await point_backing(bundled("qemu-img"), image, "127.0.0.1:10902", "vol-0123456789abcdef01234567", "node-a",
                            key=VolumeKey("another"))
    assert backing.backing_name(image) == old
    await point_backing(bundled("qemu-img"), image, "127.0.0.1:10902", "vol-0123456789abcdef01234567", "node-a",
                        key=key)
    assert backing.backing_name(image) == new and luks(image)
