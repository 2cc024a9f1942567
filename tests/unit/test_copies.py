"""Copies across nodes: what the target writes into a copy image's header, sources, ports, the catalog rows,
and who may lease: each node for itself, proven by its own certificate (over real TLS, in process)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from csi_qsd.catalog import Catalog, CopyRecord, CopyRole, CopyState, VolumeRecord, VolumeState
from csi_qsd.cli import build_parser
from csi_qsd.config import Config
from csi_qsd.controller.copy_sources import CopySources
from csi_qsd.controller.copy_targets import CopyLinkCheck, CopyTargets
from csi_qsd.copy_terms import PEER_TLS_OBJECT, CopyLease, CopyPeers, CopySettings, nbd_backing, parse_source
from csi_qsd.csi.copy_service import copy_handler
from csi_qsd.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SourceLost,
    Unavailable,
)
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.node.copy_fill import CopyFill
from csi_qsd.params import VolumeParameters
from csi_qsd.qcow2 import backing, blank, layer_bitmaps
from csi_qsd.sys import nbd_tcp
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.transport.copy_peers import SERVICE, CopyPeerNodes, StaticCopyPeers, checked_lease
from csi_qsd.transport.tls import ROUTER_NAME, PemFiles, server_credentials
from testing.certs import Pki, mint
from testing.router_cluster import copies_call
from tests.fakes import FakeNode, fake_node


def test_the_backing_names_the_export_over_tls_with_bounded_waits() -> None:
    name = nbd_backing("10.0.0.7:10901", "vol-0123456789abcdef01234567", "node-a")
    assert name.startswith("json:")
    spec = json.loads(name[5:])
    nbd = spec["file"]
    assert spec["driver"] == "raw" and nbd["driver"] == "nbd"
    assert nbd["server"] == {"type": "inet", "host": "10.0.0.7", "port": "10901"}
    assert nbd["tls-creds"] == PEER_TLS_OBJECT and nbd["tls-hostname"] == "node-a"  # the source node's own name
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
    assert backing.names_backing(image)
    alone = tmp_path / "alone.qcow2"
    with open(alone, "wb") as f:
        blank.write(f.fileno(), blank.image_bytes(1 << 26, 1 << 16, layer_bitmaps.OWN))
    assert not backing.names_backing(alone)


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


def test_a_peer_on_another_host_is_refused_with_a_loopback_copy_address(tmp_path: Path) -> None:
    """A lease would send the other node to its own loopback: the start is refused, saying what to set."""
    tls = PemFiles(tmp_path / "c", tmp_path / "k", tmp_path / "ca")
    for copy_address, listener in (("", "[::]:9811"), ("", "127.0.0.1:9811"), ("127.0.0.1", "10.0.0.2:9811"),
                                   ("::1", ""), ("localhost", "")):
        with pytest.raises(ValueError, match="--peer node-a is another host.*--copy-address"):
            Config(state_dir=tmp_path, metadata_tls=tls, metadata_address=listener, copy_address=copy_address,
                   peers=(("node-a", "10.0.0.1:9811"),))
    served = Config(state_dir=tmp_path, metadata_tls=tls, metadata_address="[::]:9811", copy_address="10.0.0.2",
                    peers=(("node-a", "10.0.0.1:9811"),))
    assert served.copy_host == "10.0.0.2"
    assert Config(state_dir=tmp_path, metadata_tls=tls, metadata_address="10.0.0.2:9811",
                  peers=(("node-a", "10.0.0.1:9811"),)).copy_host == "10.0.0.2"
    # Every peer on this very host (one machine playing several nodes): loopback reaches them all.
    assert Config(state_dir=tmp_path, metadata_tls=tls, metadata_address="127.0.0.1:9811",
                  peers=(("node-a", "127.0.0.1:9812"), ("node-c", "localhost:9813"))).copy_host == "127.0.0.1"


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


# What QSD would connect to when it opens a chain, read from the headers alone ------------------------------


def _qcow2(path: Path, backing: str = "", backing_format: str = "qcow2") -> Path:
    with open(path, "wb") as f:
        blank.write(f.fileno(), blank.image_bytes(1 << 26, 1 << 16, layer_bitmaps.OWN, backing=backing,
                                                  backing_format=backing_format if backing else ""))
    return path


def test_a_chain_names_the_link_of_the_copy_image_below_it(tmp_path: Path) -> None:
    copy = _qcow2(tmp_path / "vol-a-copy.qcow2", nbd_backing("10.0.0.7:10901", "e", "n"), "raw")
    top = _qcow2(tmp_path / "vol-a.qcow2", copy.name)
    clone = _qcow2(tmp_path / "vol-b.qcow2", str(top))
    assert backing.nbd_links(clone) == backing.nbd_links(top) == backing.nbd_links(copy) == ["10.0.0.7:10901"]
    assert backing.nbd_links(_qcow2(tmp_path / "alone.qcow2")) == []
    assert backing.nbd_links(_qcow2(tmp_path / "dangling.qcow2", "gone.qcow2")) == []
    (tmp_path / "raw.img").write_bytes(b"\0" * 4096)
    assert backing.nbd_links(tmp_path / "raw.img") == []
    assert backing.nbd_address(nbd_backing("[fd00::1]:10901", "e", "n")) == "[fd00::1]:10901"


async def _nbd_greeter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(nbd_tcp.NBD_GREETING + b"\0\3")
    await writer.drain()
    await reader.read(20)
    writer.close()


async def test_only_a_server_that_greets_answers() -> None:
    loop = asyncio.get_running_loop()
    greeter = await asyncio.start_server(_nbd_greeter, "127.0.0.1", 0)
    with socket.socket() as silent, socket.socket() as closed:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # accepts (the kernel does) but never speaks: a port something else holds
        closed.bind(("127.0.0.1", 0))
        async with greeter:
            address = "127.0.0.1:%d" % greeter.sockets[0].getsockname()[1]
            assert await nbd_tcp.answers(address, 2.0)
            started = loop.time()
            assert not await nbd_tcp.answers("127.0.0.1:%d" % silent.getsockname()[1], 0.3)
            assert not await nbd_tcp.answers("127.0.0.1:%d" % closed.getsockname()[1], 0.3)
            assert loop.time() - started < 1.5


async def test_a_volume_whose_link_does_not_greet_is_unavailable_naming_the_node(tmp_path: Path) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        copy = _qcow2(tmp_path / "vol-0123456789abcdef01234567-copy.qcow2", nbd_backing(address, "e", "n"), "raw")
        top = _qcow2(tmp_path / "vol-0123456789abcdef01234567.qcow2", copy.name)
        volume = VolumeRecord(id="vol-0123456789abcdef01234567", name="v", capacity=1 << 26,
                              params=VolumeParameters(), image=top, state=VolumeState.READY, pool="default",
                              created_at=1.0)
        async with Catalog(tmp_path / "catalog.db") as catalog:
            check = CopyLinkCheck(catalog, timeout=0.3)
            await check(volume)  # no copy under way: not even the headers are read
            await catalog.put_copy(CopyRecord(
                volume_id=volume.id, role=CopyRole.TARGET, node="node-a", source="snapshot:snap-" + "0" * 24,
                state=CopyState.STREAMING, created_at=1.0, snapshot_id="snap-" + "0" * 24, address=address,
                image=str(copy)))
            with pytest.raises(Unavailable) as refused:
                await check(volume)
            assert "node node-a" in str(refused.value) and address in str(refused.value) and volume.id in str(
                refused.value)


# Deletes of what a copy reads, and leases, exclude each other --------------------------------------------


@pytest.fixture
async def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeNode, CopySources]]:
    async def serving(self: CopySources, record: CopyRecord, subject: str) -> CopyRecord:
        return record  # no qemu-nbd: what is under test is the catalog and the locks

    monkeypatch.setattr(CopySources, "_serve", serving)
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text(name)
    async with fake_node(tmp_path) as node:
        settings = CopySettings(state_dir=tmp_path / "state", tls=(tmp_path / "cert", tmp_path / "key", tmp_path / "ca"),
                                ports=range(40000, 40100))
        leases = CopySources(node.catalog, node.snapshots, settings, node.volumes._volume_locks)
        node.snapshots.before_delete = leases.refuse_snapshot_delete
        node.volumes.before_delete = leases.refuse_volume_delete
        yield node, leases


COPY = "vol-0123456789abcdef0123ffff"


async def _refused_for_the_copy(delete: Awaitable[None]) -> None:
    """The delete is FAILED_PRECONDITION naming the copying volume and its node."""
    with pytest.raises(FailedPrecondition) as refused:
        await delete
    assert COPY in str(refused.value) and "node-b" in str(refused.value)


async def test_a_leased_snapshot_is_not_deleted(source: tuple[FakeNode, CopySources]) -> None:
    node, leases = source
    volume = await node.new_volume()
    snapshot = await node.snapshots.create("snap", volume.id)
    await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")
    await _refused_for_the_copy(node.snapshots.delete(snapshot.id))
    await leases.release(COPY)
    await node.snapshots.delete(snapshot.id)
    assert await node.snapshots.get(snapshot.id) is None


async def test_a_lease_and_a_delete_at_the_same_moment_never_both_pass(
        source: tuple[FakeNode, CopySources], monkeypatch: pytest.MonkeyPatch) -> None:
    node, leases = source
    volume = await node.new_volume()
    snapshot = await node.snapshots.create("snap", volume.id)
    # The delete has looked for leases and found none; it pauses before it acts.
    looked, go_on = asyncio.Event(), asyncio.Event()
    dependants = node.catalog.dependants

    async def paused(image: str) -> int:
        looked.set()
        await go_on.wait()
        return await dependants(image)

    monkeypatch.setattr(node.catalog, "dependants", paused)
    deleting = asyncio.create_task(node.snapshots.delete(snapshot.id))
    await looked.wait()
    with pytest.raises(Aborted):
        await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")
    go_on.set()
    await deleting
    with pytest.raises(NotFound):
        await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")
    assert await node.catalog.copies(CopyRole.SOURCE) == []


async def test_a_cloned_volume_is_not_deleted(source: tuple[FakeNode, CopySources]) -> None:
    node, leases = source
    volume = await node.new_volume()
    await leases.lease(COPY, "node-b", f"volume:{volume.id}")
    leased = await node.volumes.get(volume.id)
    assert leased is not None
    await _refused_for_the_copy(node.volumes.delete(volume.id))
    assert await node.volumes.get(volume.id) == leased, "a refused delete must leave the volume as it was"
    assert leased.image.exists()
    await leases.release(COPY)
    await node.volumes.delete(volume.id)
    assert await node.volumes.get(volume.id) is None, "once the lease is released the delete must go through"
    await node.volumes.freed()
    assert not leased.image.exists(), "the deleted volume's image must go"


async def test_a_group_snapshot_whose_member_a_copy_reads_is_not_deleted(
        source: tuple[FakeNode, CopySources]) -> None:
    node, leases = source
    first, second = await node.new_volume("pvc-1"), await node.new_volume("pvc-2")
    group = await node.snapshots.create_group("group", [first.id, second.id])
    await leases.lease(COPY, "node-b", f"snapshot:{group.members[1].id}")
    await _refused_for_the_copy(node.snapshots.delete_group(group.id))
    assert len((await node.snapshots.get_group(group.id) or group).members) == 2  # none went
    await leases.release(COPY)
    await node.snapshots.delete_group(group.id)
    assert await node.snapshots.get_group(group.id) is None


# Who may lease: each node for itself --------------------------------------------------------------------


async def test_a_lease_belongs_to_the_node_it_was_granted_to(source: tuple[FakeNode, CopySources]) -> None:
    node, leases = source
    volume = await node.new_volume()
    snapshot = await node.snapshots.create("snap", volume.id)
    await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")
    for other in (leases.lease(COPY, "node-c", f"snapshot:{snapshot.id}"), leases.release(COPY, "node-c")):
        with pytest.raises(PermissionDenied) as refused:
            await other
        assert "node-b" in str(refused.value) and "node-c" in str(refused.value) and COPY in str(refused.value)
    await _refused_for_the_copy(node.snapshots.delete(snapshot.id))  # still node-b's lease
    assert (await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")).snapshot_id == snapshot.id
    await leases.release(COPY, "node-b")
    await node.snapshots.delete(snapshot.id)


async def test_a_lease_is_served_to_the_subject_its_node_asked_with_across_restarts(
        source: tuple[FakeNode, CopySources], monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy server lets in the subject of the certificate the lease's node presented; a driver that starts
    again serves it to that same subject (kept beside the pid file), and the next Lease replaces it."""
    node, leases = source
    served: list[str] = []

    async def serving(self: CopySources, record: CopyRecord, subject: str) -> CopyRecord:
        served.append(subject)
        return record

    monkeypatch.setattr(CopySources, "_serve", serving)
    snapshot = await node.snapshots.create("snap", (await node.new_volume()).id)
    await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}", "C=US,O=SPIRE,CN=node-b,2.5.4.45=#0c0161")
    await leases.reconcile()
    await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}", "CN=node-b")
    await leases.reconcile()
    assert served == ["C=US,O=SPIRE,CN=node-b,2.5.4.45=#0c0161"] * 2 + ["CN=node-b"] * 2
    await leases.release(COPY, "node-b")
    assert not list(leases._settings.copies_dir.glob(f"{COPY}.*"))


def test_the_nbd_server_admits_one_exact_subject() -> None:
    """No glob: `authz-simple` compares the whole string (qemu-nbd refusing look-alikes is
    tests/integration/test_copy_server_identity.py)."""
    spec = json.loads(nbd_tcp.authz_object("C=US,O=SPIRE,CN=node-b"))
    assert spec == {"qom-type": "authz-simple", "id": nbd_tcp.AUTHZ_OBJECT_ID, "identity": "C=US,O=SPIRE,CN=node-b"}


async def test_the_copy_service_answers_each_peer_for_itself_only(
        source: tuple[FakeNode, CopySources], tmp_path: Path) -> None:
    """Node A's copy service over mutual TLS: B leases for itself; C (a peer, same CA) may not lease or release
    B's copy, nor lease for B; the router's certificate and one naming no peer are refused altogether."""
    node, leases = source
    snapshot = await node.snapshots.create("snap", (await node.new_volume()).id)
    pki = mint(tmp_path / "pki")
    server = grpc.aio.server()
    known = StaticCopyPeers((("node-b", "127.0.0.1:1"), ("node-c", "127.0.0.1:1")))
    server.add_generic_rpc_handlers((copy_handler(leases, known),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(pki.for_node("node-a")))
    await server.start()
    try:
        address, b, c = f"127.0.0.1:{port}", pki.for_node("node-b"), pki.for_node("node-c")
        lease = {"source": f"snapshot:{snapshot.id}", "copy_volume_id": COPY}
        assert await copies_call(address, b, "Lease", {**lease, "node": "node-b"}) == (grpc.StatusCode.OK, "")
        for method, request in (("Lease", {**lease, "node": "node-b"}), ("Lease", {**lease, "node": "node-c"}),
                                ("Release", {"copy_volume_id": COPY, "node": "node-c"}),
                                ("Release", {"copy_volume_id": COPY})):
            code, message = await copies_call(address, c, method, request)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "node-b" in message and "node-c" in message, (
                method, request, message)
        for name, files in ((ROUTER_NAME, pki.router), ("intruder", pki.for_node("intruder"))):
            code, message = await copies_call(address, files, "Lease", {**lease, "node": name})
            assert code == grpc.StatusCode.PERMISSION_DENIED and repr(name) in message and "--peer" in message, message
        # A node's certificate for another name does not pass for node-a: B checks whom it dials.
        code, _ = await copies_call(address, b, "Lease", {**lease, "node": "node-b"}, server_name="node-x")
        assert code == grpc.StatusCode.UNAVAILABLE
        assert await node.catalog.copy(COPY, CopyRole.SOURCE) is not None
        assert await copies_call(address, b, "Release", {"copy_volume_id": COPY, "node": "node-b"}) == (
            grpc.StatusCode.OK, "")
        assert await node.catalog.copy(COPY, CopyRole.SOURCE) is None
    finally:
        await server.stop(None)


# No node takes more than its share ----------------------------------------------------------------------


def _copy(n: int) -> str:
    return f"vol-0123456789abcdef0123{n:04x}"


async def test_one_node_holds_at_most_its_share_of_leases(source: tuple[FakeNode, CopySources]) -> None:
    """Node B (or a thief with B's certificate) may not take every copy port: beyond --copy-leases-per-node it is
    RESOURCE_EXHAUSTED naming the limit and B, also when it asks many at once; C is served; a renewal of a
    lease B holds is never refused, and B gets another once it gives one back."""
    node, leases = source
    limited = CopySources(node.catalog, node.snapshots, dataclasses.replace(leases._settings, leases_per_node=2),
                           node.volumes._volume_locks)
    snapshot = await node.snapshots.create("snap", (await node.new_volume()).id)
    source_name = f"snapshot:{snapshot.id}"
    asked = await asyncio.gather(*(limited.lease(_copy(n), "node-b", source_name) for n in range(6)),
                                 return_exceptions=True)
    refused = [a for a in asked if isinstance(a, BaseException)]
    assert len(refused) == 4 and all(isinstance(a, ResourceExhausted) for a in refused), asked
    message = str(refused[0])
    assert "node node-b" in message and "--copy-leases-per-node 2" in message and "40000-40099" in message, message
    held = [_copy(n) for n, a in enumerate(asked) if not isinstance(a, BaseException)]
    await limited.lease(held[0], "node-b", source_name)  # a renewal
    await limited.lease(_copy(100), "node-c", source_name)
    await limited.release(held[0], "node-b")
    await limited.lease(_copy(5), "node-b", source_name)
    assert sorted(r.node for r in await node.catalog.copies(CopyRole.SOURCE)) == ["node-b", "node-b", "node-c"]


def test_the_default_share_is_half_of_the_copy_ports(tmp_path: Path) -> None:
    assert CopySettings(state_dir=tmp_path, ports=range(10900, 11000)).lease_limit == 50
    assert CopySettings(state_dir=tmp_path, ports=range(10900, 10901)).lease_limit == 1
    assert CopySettings(state_dir=tmp_path, leases_per_node=7).lease_limit == 7
    with pytest.raises(ValueError, match="--copy-leases-per-node 101"):
        Config(state_dir=tmp_path, copy_leases_per_node=101, runtime_dir=tmp_path / "run-x")
    with pytest.raises(ValueError, match="--copy-calls-per-node 0"):
        Config(state_dir=tmp_path / "s", copy_calls_per_node=0, runtime_dir=tmp_path / "run-x")


async def test_one_node_has_at_most_its_share_of_calls_in_flight(
        source: tuple[FakeNode, CopySources], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While node B has --copy-calls-per-node calls in flight, its next call is RESOURCE_EXHAUSTED naming the limit
    and B; node C is answered meanwhile, and B may call again once its call answered."""
    node, leases = source
    snapshot = await node.snapshots.create("snap", (await node.new_volume()).id)
    entered, go_on = asyncio.Event(), asyncio.Event()
    granting = leases.lease

    async def slow(copy_volume_id: str, asking: str, source_name: str, subject: str = "") -> CopyLease:
        if asking == "node-b":
            entered.set()
            await go_on.wait()
        return await granting(copy_volume_id, asking, source_name, subject)

    monkeypatch.setattr(leases, "lease", slow)
    pki = mint(tmp_path / "pki")
    server = grpc.aio.server()
    known = StaticCopyPeers((("node-b", "127.0.0.1:1"), ("node-c", "127.0.0.1:1")))
    server.add_generic_rpc_handlers((copy_handler(leases, known, calls_per_node=1),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(pki.for_node("node-a")))
    await server.start()
    try:
        address, b, c = f"127.0.0.1:{port}", pki.for_node("node-b"), pki.for_node("node-c")

        def lease(n: int, name: str) -> dict[str, str]:
            return {"source": f"snapshot:{snapshot.id}", "copy_volume_id": _copy(n), "node": name}

        first = asyncio.create_task(copies_call(address, b, "Lease", lease(1, "node-b")))
        await asyncio.wait_for(entered.wait(), 10)
        for method, request in (("Lease", lease(2, "node-b")), ("Release", {"copy_volume_id": _copy(1)})):
            code, message = await copies_call(address, b, method, request)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, code, message)
            assert "node node-b" in message and "--copy-calls-per-node 1" in message, message
        assert await copies_call(address, c, "Lease", lease(3, "node-c")) == (grpc.StatusCode.OK, "")
        go_on.set()
        assert await first == (grpc.StatusCode.OK, "")
        assert await copies_call(address, b, "Lease", lease(2, "node-b")) == (grpc.StatusCode.OK, "")
    finally:
        await server.stop(None)


async def test_a_node_dials_a_peer_only_if_its_certificate_names_that_peer(tmp_path: Path) -> None:
    """Node C's certificate (same CA) listening where B thinks node-a is: B does not ask it."""
    pki = mint(tmp_path / "pki")
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", server_credentials(pki.for_node("node-c")))
    await server.start()
    peers = CopyPeerNodes(StaticCopyPeers((("node-a", f"127.0.0.1:{port}"),)), pki.for_node("node-b"), "node-b", timeout=5)
    try:
        with pytest.raises(Unavailable, match="node-a"):
            await peers.lease("snapshot:snap-" + "0" * 24, COPY)
    finally:
        await peers.close()
        await server.stop(None)


GOOD_ANSWER = {"snapshot_id": "snap-" + "1" * 24, "address": "10.0.0.5:10900", "export": COPY, "size": 1 << 26,
               "ttl": 60.0}


@pytest.mark.parametrize("change,says", [
    ({"snapshot_id": "../../etc"}, "not a snapshot ID"),
    ({"snapshot_id": None}, "not a snapshot ID"),
    ({"export": "vol-0123456789abcdef0123aaaa"}, "not the copy's own"),
    ({"export": "x;rm"}, "not the copy's own"),
    ({"address": "10.0.0.66:10900"}, "not on the peer's host"),
    ({"address": "127.0.0.1:10900"}, "not on the peer's host"),
    ({"address": "evil.example:10900"}, "not on the peer's host"),
    ({"address": "10.0.0.5:0"}, "expected HOST:PORT"),
    ({"address": "10.0.0.5:99999"}, "expected HOST:PORT"),
    ({"address": "10.0.0.5"}, "expected HOST:PORT"),
    ({"address": 5}, "expected HOST:PORT"),
    ({"size": 0}, "not a volume size"),
    ({"size": "64M"}, "not a volume size"),
    ({"size": True}, "not a volume size"),
    ({"ttl": -1}, "not a number of seconds"),
    ({"ttl": float("inf")}, "not a number of seconds"),
])
def test_a_peers_lease_is_checked_before_it_is_stored_or_dialled(change: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        checked_lease("node-a", "10.0.0.5:9811", COPY, {**GOOD_ANSWER, **change})


def test_a_peers_lease_on_its_own_host_is_taken() -> None:
    lease = checked_lease("node-a", "10.0.0.5:9811", COPY, GOOD_ANSWER)
    assert (lease.node, lease.address, lease.export, lease.size, lease.ttl) == (
        "node-a", "10.0.0.5:10900", COPY, 1 << 26, 60.0)
    v6 = checked_lease("node-a", "[fd00::5]:9811", COPY, {**GOOD_ANSWER, "address": "[fd00:0::5]:10900"})
    assert v6.address == "[fd00:0::5]:10900"
    assert checked_lease("node-a", "Node-A.example:9811", COPY,
                         {**GOOD_ANSWER, "address": "node-a.example:10900"}).node == "node-a"


async def test_a_node_named_in_its_own_peer_list_never_asks_itself(tmp_path: Path) -> None:
    """One list of peers (the ConfigMap csi-qsd-peers) serves every node, each finding itself in it."""
    peers = CopyPeerNodes(StaticCopyPeers((("node-b", "10.0.0.2:9811"),)), None, "node-b")
    with pytest.raises(NotFound, match="no other node is known"):
        await peers.lease("snapshot:snap-" + "1" * 24, COPY)


async def test_a_peer_that_answers_a_lease_pointing_elsewhere_is_not_followed(tmp_path: Path) -> None:
    """Node A (its certificate, at the address B names it by) grants a lease served on another host: B refuses
    the answer, says which node gave it and why, and stores nothing of it."""
    pki = mint(tmp_path / "pki")
    answers = [{**GOOD_ANSWER, "address": "192.0.2.77:10900"},
               {**GOOD_ANSWER, "address": "127.0.0.1:10900", "export": "vol-0123456789abcdef0123aaaa"}]

    async def lease(request: dict[str, object], context: grpc.aio.ServicerContext) -> dict[str, object]:
        return answers.pop(0)

    handler = grpc.method_handlers_generic_handler(SERVICE, {"Lease": grpc.unary_unary_rpc_method_handler(
        lease, request_deserializer=json.loads, response_serializer=lambda m: json.dumps(m).encode())})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(pki.for_node("node-a")))
    await server.start()
    peers = CopyPeerNodes(StaticCopyPeers((("node-a", f"127.0.0.1:{port}"),)), pki.for_node("node-b"), "node-b", timeout=5)
    try:
        for says in ("192.0.2.77:10900 is not on the peer's host", "not the copy's own"):
            with pytest.raises(Unavailable, match="refused its answer") as err:
                await peers.lease("snapshot:snap-" + "1" * 24, COPY)
            assert "node-a" in str(err.value) and says in str(err.value)
    finally:
        await peers.close()
        await server.stop(None)


# A copy never loses its source ------------------------------------------------------------------------------


async def test_a_flatten_keeps_the_hidden_snapshot_a_clone_on_another_node_reads(
        source: tuple[FakeNode, CopySources]) -> None:
    """The hidden cut a clone elsewhere reads is no dependant of any image once a newer snapshot is flattened,
    yet its lease keeps it (image and row) until the lease goes; then it is reclaimed."""
    node, leases = source
    volume = await node.new_volume()
    await leases.lease(COPY, "node-b", f"volume:{volume.id}")
    cut = await node.catalog.snapshot_by_name(f"copy.{COPY}")
    assert cut is not None and cut.hidden
    await node.snapshots.create("later", volume.id)
    await node.snapshots.flatten(volume.id)
    assert await node.catalog.snapshot(cut.id) is not None, "the flatten reclaimed the leased snapshot"
    assert cut.image.exists()
    await leases.release(COPY, "node-b")
    assert await node.catalog.snapshot(cut.id) is None and not cut.image.exists()


async def test_a_clone_lease_without_a_free_port_cuts_nothing(
        source: tuple[FakeNode, CopySources], monkeypatch: pytest.MonkeyPatch) -> None:
    node, leases = source
    volume = await node.new_volume()

    async def no_port(self: CopySources, copy_volume_id: str) -> int:
        raise ResourceExhausted("every copy port of this node is in use")

    monkeypatch.setattr(CopySources, "_free_port", no_port)
    for attempt in range(3):
        with pytest.raises(ResourceExhausted):
            await leases.lease(f"{COPY[:-1]}{attempt}", "node-b", f"volume:{volume.id}")
    assert await node.catalog.snapshots() == []
    assert await node.catalog.volume(volume.id) == volume  # no cut: the same image, no new top


async def test_a_clone_lease_that_fails_after_its_cut_is_retried_on_the_same_cut(
        source: tuple[FakeNode, CopySources], monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease's row cannot be written (a catalog error, or the caller gave up): nothing is leased, the cut
    stays only as a layer of the volume, and the target's retry (same copy ID) leases that cut, adding none."""
    node, leases = source
    volume = await node.new_volume()
    put_copy = node.catalog.put_copy

    async def broken(record: CopyRecord) -> None:
        raise OSError("disk I/O error")

    monkeypatch.setattr(node.catalog, "put_copy", broken)
    with pytest.raises(OSError):
        await leases.lease(COPY, "node-b", f"volume:{volume.id}")
    assert await node.catalog.copies(CopyRole.SOURCE) == []
    (cut,) = await node.catalog.snapshots()
    assert cut.hidden and cut.name == f"copy.{COPY}"
    monkeypatch.setattr(node.catalog, "put_copy", put_copy)
    lease = await leases.lease(COPY, "node-b", f"volume:{volume.id}")
    assert lease.snapshot_id == cut.id and await node.catalog.snapshots() == [cut]
    await leases.release(COPY, "node-b")


class _RefusingPeers:
    """Peers none of which can be asked: every lease is UNAVAILABLE; records the copy IDs asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> CopyLease:
        self.asked.append(copy_volume_id)
        raise Unavailable("node-a: UNAVAILABLE")

    async def release(self, node: str, copy_volume_id: str) -> None:
        pass


async def test_a_retried_copy_asks_for_the_same_copy(tmp_path: Path) -> None:
    """A CreateVolume from another node's volume that failed is retried with the same copy ID, so the source
    cuts its volume once for all the retries; another name gets an ID of its own."""
    async with fake_node(tmp_path) as node:
        peers = _RefusingPeers()
        settings = CopySettings(state_dir=tmp_path / "state", tls=(tmp_path / "c", tmp_path / "k", tmp_path / "ca"))
        remote = CopyTargets(node.catalog, node.pool, peers, settings, node.volumes.name_locks)
        source = "volume:vol-" + "1" * 24
        for name in ("pvc-1", "pvc-1", "pvc-1", "pvc-2"):
            with pytest.raises(Unavailable):
                await remote.create(name, 1 << 26, 0, VolumeParameters(), [], source=source)
        assert peers.asked[0] == peers.asked[1] == peers.asked[2] != peers.asked[3]
        assert await node.catalog.copies(CopyRole.TARGET) == []


class _HeldPeers(_RefusingPeers):
    """Peers whose lease waits until `go` is set, then is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.asking, self.go = asyncio.Event(), asyncio.Event()

    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> CopyLease:
        self.asking.set()
        await self.go.wait()
        return await super().lease(source, copy_volume_id)


async def test_a_name_has_one_lock_whether_its_volume_comes_from_this_node_or_another(tmp_path: Path) -> None:
    """CreateVolume of one name twice at once, one from another node's snapshot (asking it), one blank here:
    the second is ABORTED, as the CSI spec's concurrency rule says, not a UNIQUE failure of the catalog."""
    async with fake_node(tmp_path) as node:
        peers = _HeldPeers()
        settings = CopySettings(state_dir=tmp_path / "state", tls=(tmp_path / "c", tmp_path / "k", tmp_path / "ca"))
        remote = CopyTargets(node.catalog, node.pool, peers, settings, node.volumes.name_locks)
        copying = asyncio.create_task(remote.create("pvc-1", 1 << 26, 0, VolumeParameters(), [],
                                                    source="snapshot:snap-" + "1" * 24))
        await peers.asking.wait()
        with pytest.raises(Aborted, match="pvc-1"):
            await node.new_volume("pvc-1")
        peers.go.set()
        with pytest.raises(Unavailable):
            await copying
        assert (await node.new_volume("pvc-1")).name == "pvc-1"


# Nothing is held forever --------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_lease_its_copy_stops_asking_for_expires_and_frees_its_snapshot(
        source: tuple[FakeNode, CopySources]) -> None:
    node, served = source
    clock = _Clock()
    settings = dataclasses.replace(served._settings, lease_ttl=60.0)
    leases = CopySources(node.catalog, node.snapshots, settings, node.volumes._volume_locks, clock=clock)
    node.snapshots.before_delete = leases.refuse_snapshot_delete
    snapshot = await node.snapshots.create("snap", (await node.new_volume()).id)
    assert (await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")).ttl == 60.0
    clock.now += 50
    assert await leases.expire() == []
    assert (await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")).snapshot_id == snapshot.id  # renewed
    clock.now += 50
    assert await leases.expire() == []
    ((record, idle),) = await leases.leases()
    assert record.volume_id == COPY and idle == 50
    clock.now += 11
    assert await leases.expire() == [COPY]
    assert await leases.leases() == []
    await node.snapshots.delete(snapshot.id)


async def test_an_operator_drops_a_lease(source: tuple[FakeNode, CopySources]) -> None:
    node, leases = source
    volume = await node.new_volume()
    await leases.lease(COPY, "node-b", f"volume:{volume.id}")
    cut = await node.catalog.snapshot_by_name(f"copy.{COPY}")
    assert cut is not None
    dropped = await leases.drop(COPY)
    assert dropped.node == "node-b" and dropped.snapshot_id == cut.id
    ((revoked, _),) = await leases.leases()
    assert revoked.state is CopyState.REVOKED and not revoked.snapshot_id and not revoked.address
    with pytest.raises(NotFound, match="operator"):  # the copy's node, back, cannot have it again
        await leases.lease(COPY, "node-b", f"volume:{volume.id}")
    with pytest.raises(NotFound, match=COPY):
        await leases.drop(COPY)
    await node.volumes.delete(volume.id)  # no longer refused
    await leases.release(COPY, "node-b")  # the copy's node gives it up: nothing is remembered any more
    assert await node.catalog.copies(CopyRole.SOURCE) == []


class _ServingPeers(_RefusingPeers):
    """A source that answers every lease with `snapshot_id`, as node `answering`; records whom each lease was
    asked of ('' : every peer) and the releases."""

    def __init__(self, snapshot_id: str, answering: str = "node-a") -> None:
        super().__init__()
        self.snapshot_id = snapshot_id
        self.answering = answering
        self.asked_of: list[str] = []
        self.released: list[str] = []
        self.released_on: list[str] = []

    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> CopyLease:
        self.asked.append(copy_volume_id)
        self.asked_of.append(node)
        return CopyLease(self.answering, self.snapshot_id, "127.0.0.1:1", copy_volume_id, 1 << 26, 60.0)

    async def release(self, node: str, copy_volume_id: str) -> None:
        self.released.append(copy_volume_id)
        self.released_on.append(node)


def _streaming(source: str) -> CopyRecord:
    """A copy on this node whose lease node-a granted, streaming."""
    return CopyRecord(volume_id=COPY, role=CopyRole.TARGET, node="node-a", source=source, state=CopyState.STREAMING,
                      created_at=1.0, snapshot_id="snap-" + "0" * 24)


def _streams(catalog: Catalog, peers: CopyPeers, tmp_path: Path) -> CopyFill:
    return CopyFill(catalog, cast(ExportPaths, None), KeyedLocks("volume"), peers, CopySettings(state_dir=tmp_path))


async def test_a_copy_whose_source_now_serves_another_snapshot_is_lost_not_mixed(tmp_path: Path) -> None:
    """The source dropped the copy's lease (it expired while this node was away) and leased a new cut: the copy
    must not read on from it; the new lease goes back at once."""
    record = _streaming("volume:vol-" + "1" * 24)
    async with Catalog(tmp_path / "catalog.db") as catalog:
        same = _ServingPeers(record.snapshot_id)
        assert (await _streams(catalog, same, tmp_path)._renew(record, COPY)).ttl == 60.0 and same.released == []
        other = _ServingPeers("snap-" + "9" * 24)
        with pytest.raises(SourceLost, match="no longer"):
            await _streams(catalog, other, tmp_path)._renew(record, COPY)
        assert other.released == [COPY]
        with pytest.raises(SourceLost):
            await _streams(catalog, _NoSource(), tmp_path)._renew(record, COPY)


async def test_a_renewal_is_asked_of_the_granting_node_and_another_node_s_answer_is_refused(tmp_path: Path) -> None:
    """The copy's lease was granted by node-a: its renewal is asked of node-a alone; a lease that node-c grants
    in its place (a compromised peer answering for another) is given back to node-c and never followed."""
    record = _streaming("snapshot:snap-" + "0" * 24)
    async with Catalog(tmp_path / "catalog.db") as catalog:
        honest = _ServingPeers(record.snapshot_id)
        assert (await _streams(catalog, honest, tmp_path)._renew(record, COPY)).node == "node-a"
        assert honest.asked_of == ["node-a"]
        impostor = _ServingPeers(record.snapshot_id, answering="node-c")
        with pytest.raises(Unavailable, match="node node-c answered .* only that node") as refused:
            await _streams(catalog, impostor, tmp_path)._renew(record, COPY)
        assert "node-a" in str(refused.value) and impostor.released_on == ["node-c"]


def _granting_peer(pki: Pki, name: str, asked: list[str]) -> tuple[grpc.aio.Server, int]:
    """A peer `name` (its own certificate) that grants every Lease (recording `name` in `asked`) and releases."""

    async def lease(request: dict[str, object], context: grpc.aio.ServicerContext) -> dict[str, object]:
        asked.append(name)
        return {**GOOD_ANSWER, "address": "127.0.0.1:10900"}

    async def release(request: dict[str, object], context: grpc.aio.ServicerContext) -> dict[str, object]:
        asked.append(f"release@{name}")
        return {}

    codec = {"request_deserializer": json.loads, "response_serializer": lambda m: json.dumps(m).encode()}
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Lease": grpc.unary_unary_rpc_method_handler(lease, **codec),
        "Release": grpc.unary_unary_rpc_method_handler(release, **codec)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    return server, server.add_secure_port("127.0.0.1:0", server_credentials(pki.for_node(name)))


async def test_two_peers_granting_one_source_is_refused_and_a_renewal_asks_one(tmp_path: Path) -> None:
    """Two of B's peers, node-a (which holds the snapshot) and node-c (which answers for it too): a new lease is
    refused, both given back, since IDs are unique and one of them lies; a renewal of node-a's lease asks
    node-a alone, over its own channel, so node-c cannot answer it."""
    pki = mint(tmp_path / "pki")
    asked: list[str] = []
    (a, port_a), (c, port_c) = _granting_peer(pki, "node-a", asked), _granting_peer(pki, "node-c", asked)
    await a.start()
    await c.start()
    peers = CopyPeerNodes(StaticCopyPeers((("node-a", f"127.0.0.1:{port_a}"), ("node-c", f"127.0.0.1:{port_c}"))),
                      pki.for_node("node-b"), "node-b", timeout=5)
    source = "snapshot:snap-" + "1" * 24
    try:
        with pytest.raises(FailedPrecondition, match="more than one node") as refused:
            await peers.lease(source, COPY)
        assert "node-a" in str(refused.value) and "node-c" in str(refused.value)
        assert sorted(asked) == ["node-a", "node-c", "release@node-a", "release@node-c"]
        asked.clear()
        assert (await peers.lease(source, COPY, "node-a")).node == "node-a" and asked == ["node-a"]
        with pytest.raises(Unavailable, match="node-x"):
            await peers.lease(source, COPY, "node-x")
    finally:
        await peers.close()
        await a.stop(None)
        await c.stop(None)


class _NoSource(_RefusingPeers):
    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> CopyLease:
        raise NotFound(f"{source} does not exist on this node nor on any of the 1 others")


def test_a_server_older_than_its_certificate_files_is_known(tmp_path: Path) -> None:
    """qemu-nbd reads its certificate once: one started before the files were last written serves the old one."""
    (tmp_path / "server-cert.pem").write_text("x")
    pid = os.getpid()
    os.utime(tmp_path / "server-cert.pem", (time.time() + 3600,) * 2)  # written after this process started
    files = [tmp_path / "server-cert.pem"]
    assert nbd_tcp.started_before(pid, files)
    os.utime(tmp_path / "server-cert.pem", (1.0, 1.0))  # long before
    assert not nbd_tcp.started_before(pid, files)
    assert not nbd_tcp.started_before(2 ** 22 + 1, files)  # no such process: cannot tell


async def test_a_node_presents_its_renewed_certificate_to_peers_without_a_restart(
        source: tuple[FakeNode, CopySources], tmp_path: Path) -> None:
    """Node B's files replaced in place (kubelet swapping a renewed Secret): its next call to a peer presents the
    new certificate; here the peer trusts only the new CA, so B goes from refused to answered."""
    _, leases = source
    old, new = mint(tmp_path / "old"), mint(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    files = PemFiles(live / "tls.crt", live / "tls.key", live / "ca.crt")
    b_old, b_new = old.for_node("node-b"), new.for_node("node-b")
    for source_file, target in zip((b_old.cert, b_old.key, new.cluster.ca_path), (files.cert, files.key, files.ca)):
        shutil.copyfile(source_file, target)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((copy_handler(leases, StaticCopyPeers((("node-b", "127.0.0.1:1"),))),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(new.for_node("node-a")))
    await server.start()
    peers = CopyPeerNodes(StaticCopyPeers((("node-a", f"127.0.0.1:{port}"),)), files, "node-b", timeout=5)
    try:
        with pytest.raises(Unavailable, match="node-a"):  # A does not trust the old CA
            await peers.lease("snapshot:snap-" + "0" * 24, COPY)
        for source_file, target in zip((b_new.cert, b_new.key), (files.cert, files.key)):
            shutil.copyfile(source_file, target)
            os.utime(target, (time.time() + 5,) * 2)  # a later modification time, as a swap gives
        with pytest.raises(NotFound):  # asked and answered: no such snapshot there
            await peers.lease("snapshot:snap-" + "0" * 24, COPY)
    finally:
        await peers.close()
        await server.stop(None)


def test_peers_from_pods_is_checked_at_start(tmp_path: Path) -> None:
    """Found in the Kubernetes API, the peers are other hosts: everything they need is asked for by name."""
    tls = PemFiles(tmp_path / "c", tmp_path / "k", tmp_path / "ca")
    pods: dict[str, Any] = {"peers_from_pods": "app.kubernetes.io/component=node", "kubernetes_api": "10.96.0.1:443"}
    config = Config(state_dir=tmp_path, metadata_tls=tls, metadata_address="10.244.0.5:9811",
                    peers_from_pods="app.kubernetes.io/component=node", kubernetes_api="10.96.0.1:443")
    assert config.copies_with_peers and config.metadata_port == 9811 and config.copy_host == "10.244.0.5"
    assert not Config(state_dir=tmp_path).copies_with_peers
    for wrong, message in (
            ({"metadata_address": ""}, "needs --metadata-address"),
            ({"kubernetes_api": ""}, "this is not a pod: KUBERNETES_SERVICE_HOST"),
            ({"peers": (("node-a", "10.0.0.1:9811"),)}, "either with --peer or with --peers-from-pods"),
            ({"metadata_address": "127.0.0.1:9811"}, "--peers-from-pods finds pods on other hosts.*--copy-address")):
        with pytest.raises(ValueError, match=message):
            Config(state_dir=tmp_path, **{"metadata_tls": tls, "metadata_address": "10.244.0.5:9811", **pods, **wrong})


class _ChangingPeers:
    """A peer list that changes between calls, as the API's does when a pod is made again."""

    def __init__(self) -> None:
        self.now: dict[str, str] = {}

    async def current(self) -> dict[str, str]:
        return dict(self.now)

    def described(self) -> str:
        return "--peers-from-pods app=x"


async def test_the_peer_list_is_read_again_for_each_copy(tmp_path: Path) -> None:
    """No peer yet: NotFound naming where peers come from; then the new entry is the one dialled."""
    pki = mint(tmp_path / "pki")
    changing = _ChangingPeers()
    peers = CopyPeerNodes(changing, pki.for_node("node-b"), "node-b", timeout=2)
    try:
        with pytest.raises(NotFound, match=r"no other node is known \(--peers-from-pods app=x\)"):
            await peers.lease("snapshot:snap-" + "1" * 24, COPY)
        changing.now = {"node-a": "127.0.0.1:1", "node-b": "10.0.0.2:9811"}
        with pytest.raises(Unavailable, match=r"node-a \(127\.0\.0\.1:1\): UNAVAILABLE"):
            await peers.lease("snapshot:snap-" + "1" * 24, COPY)
        changing.now = {"node-a": "127.0.0.1:2"}
        with pytest.raises(Unavailable, match=r"node-a \(127\.0\.0\.1:2\): UNAVAILABLE"):
            await peers.lease("snapshot:snap-" + "1" * 24, COPY)
    finally:
        await peers.close()


async def test_a_dropped_lease_stays_dropped_past_any_ttl_until_lifted(source: tuple[FakeNode, CopySources]) -> None:
    """The drop is not forgotten after a TTL: the copy's node, back days later, is still refused; the operator's
    lift (`csi-qsd volume lift-lease`) lets it lease the copy again."""
    node, served = source
    clock = _Clock()
    settings = dataclasses.replace(served._settings, lease_ttl=8.0)
    leases = CopySources(node.catalog, node.snapshots, settings, node.volumes._volume_locks, clock=clock)
    snapshot = await node.snapshots.create("snap", (await node.new_volume()).id)
    await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")
    with pytest.raises(NotFound, match=COPY):  # nothing to lift before a drop
        await leases.lift(COPY)
    await leases.drop(COPY)
    for _ in range(3):
        clock.now += 14
        assert await leases.expire() == []
        with pytest.raises(NotFound, match="operator"):
            await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")
    ((revoked, _),) = await leases.leases()
    assert revoked.state is CopyState.REVOKED
    assert (await leases.lift(COPY)).node == "node-b"
    assert (await leases.lease(COPY, "node-b", f"snapshot:{snapshot.id}")).snapshot_id == snapshot.id
    await leases.release(COPY, "node-b")
