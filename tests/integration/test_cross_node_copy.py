"""Restores and clones onto another node: two `csi-qsd serve` processes as two nodes, over mutual TLS.

Node A holds a block volume with a known pattern and a snapshot of it; node
B is given A as a peer (`--peer`) and a slow copy rate, so the copy is still
streaming while the test crashes each side. B's volume must be usable at
once (its first bytes read through NBD from A), survive a SIGKILL of B's
driver and QSD and a SIGKILL of A's driver, QSD and NBD server, report
abnormal while A is gone, finish, give A's lease back, and hold the
snapshot's bytes exactly. A refuses to delete what a copy reads. Each node
has a certificate of its own; a third node's (C, one of A's peers, same CA)
may neither lease nor release B's copy nor read what A serves B.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.sys.run import run
from csi_qsd.sys.tools import bundled
from csi_qsd.transport.tls import ROUTER_NAME, PemFiles
from testing.certs import Pki, crafted_intruder, mint
from testing.harness import Sandbox, free_port, qsd_pids, until
from testing.helpers.cli_process import csi_qsd
from testing.helpers.nbd_tls import nbd_info
from testing.router_cluster import Node, copies_call, node_plugin

MIB = 1 << 20
SIZE = 64 * MIB
RATE = 4 * MIB  # bytes/s: the 64 MiB copy takes ~16 s, long enough to crash each side during it


def _pattern(seed: int) -> bytes:
    return random.Random(seed).randbytes(SIZE)


def _write(device: Path, data: bytes) -> None:
    fd = os.open(device, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, 0) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(device: Path, offset: int, length: int) -> bytes:
    fd = os.open(device, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read what the volume holds, not the page cache
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _copy_servers(box: Sandbox) -> list[int]:
    pids = []
    for pid_file in (box.state_dir / "copies").glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pid_file.read_text()))
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def _node(name: str, pki: Pki, address: str, *extra: str) -> AsyncIterator[Node]:
    """A node plugin; the NBD servers it leaves running for copies (the data plane) go with the test."""
    async with node_plugin(name, pki, *extra, address=address) as node:
        try:
            yield node
        finally:
            _kill(_copy_servers(node.box))


@dataclasses.dataclass
class Pair:
    a: Node
    b: Node
    pki: Pki


@contextlib.asynccontextmanager
async def _pair(tmp_path: Path, *a_extra: str) -> AsyncIterator[Pair]:
    """Node A (the source, `a_extra` flags) copies with B; B (the target) copies from A, slowly."""
    pki = mint(tmp_path / "pki")
    a_address, b_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    low = free_port()
    async with _node("node-a", pki, a_address, "--copy-ports", f"{low}-{low + 4}", "--peer", f"node-b={b_address}",
                     *a_extra) as a, \
            _node("node-b", pki, b_address, "--peer", f"node-a={a_address}", "--copy-rate", str(RATE)) as b:
        yield Pair(a, b, pki)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    """A copies with B and with C, which runs no plugin here."""
    async with _pair(tmp_path, "--peer", f"node-c=127.0.0.1:{free_port()}") as pair:
        yield pair


async def _condition(node: Node, volume_id: str) -> pb.VolumeCondition:
    answer: pb.ControllerGetVolumeResponse = await node.csi.controller.ControllerGetVolume(
        pb.ControllerGetVolumeRequest(volume_id=volume_id), timeout=30)
    return answer.status.volume_condition


async def _code(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError("the call succeeded")


async def _as_the_co(call: Callable[[], Awaitable[None]]) -> None:
    """Retry a call answered ABORTED (another operation holds the volume), as kubelet does."""
    for _ in range(100):
        try:
            await call()
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
        await asyncio.sleep(0.1)
    raise AssertionError("ABORTED for 10 s")


async def _block_volume(node: Node, name: str, data: bytes, *, keep_staged: bool = True) -> tuple[str, Path]:
    vid = (await node.csi.create_volume(name, SIZE, block=True)).volume_id
    staging, target = node.box.staging(vid), node.box.target(vid)
    await node.csi.stage(vid, str(staging), block=True)
    await node.csi.publish(vid, str(staging), str(target), block=True)
    await asyncio.to_thread(_write, target, data)
    if not keep_staged:
        await node.csi.unpublish(vid, str(target))
        await node.csi.unstage(vid, str(staging))
    return vid, target


async def test_restore_on_another_node_survives_a_crash_of_each_side(pair: Pair) -> None:
    a, b = pair.a, pair.b
    data = _pattern(19)
    source_vid, _ = await _block_volume(a, "source", data)
    snapshot = (await a.csi.create_snapshot("snap", source_vid)).snapshot_id

    loop = asyncio.get_running_loop()
    started = loop.time()
    copy = await b.csi.create_volume("restored", SIZE, block=True, from_snapshot=snapshot)
    created = loop.time() - started
    vid = copy.volume_id
    assert copy.content_source.snapshot.snapshot_id == snapshot
    assert created < 10, f"CreateVolume took {created:.1f}s: it must not wait for the copy"
    # Idempotent: the same request answers the same volume.
    again = await b.csi.create_volume("restored", SIZE, block=True, from_snapshot=snapshot)
    assert again.volume_id == vid
    # Not staged while it fills: healthy (its image is checked alone, not through the link to node A).
    condition = await _condition(b, vid)
    assert not condition.abnormal and "being copied from node node-a" in condition.message, condition

    code, message = await _code(a.csi.delete_snapshot(snapshot))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and vid in message and "node-b" in message, message

    # Usable at once: stage, publish and read through to node A.
    staging, target = b.box.staging(vid), b.box.target(vid)
    await _as_the_co(lambda: b.csi.stage(vid, str(staging), block=True))
    await _as_the_co(lambda: b.csi.publish(vid, str(staging), str(target), block=True))
    assert await asyncio.to_thread(_read, target, SIZE - MIB, MIB) == data[SIZE - MIB:]
    condition = await _condition(b, vid)
    assert not condition.abnormal and "being copied from node node-a" in condition.message, condition

    # SIGKILL of the target's driver and QSD mid-stream: the restarted driver resumes the copy.
    await until(lambda: _progress(b, vid, 5), "the copy under way", 30, interval=0.2)
    b_qsd = qsd_pids(b.box.state_dir)
    await b.process.kill9()
    _kill(b_qsd)
    await b.process.start(timeout=60)
    await until(lambda: _progress(b, vid, 1), lambda: f"the copy resumed on node-b; log:\n{b.process.log()[-3000:]}",
                60, interval=0.2)
    assert await asyncio.to_thread(_read, target, 0, MIB) == data[:MIB]

    # SIGKILL of the source's driver, QSD and NBD server mid-stream: B reports abnormal, then finishes.
    a_pids = qsd_pids(a.box.state_dir) + _copy_servers(a.box)
    await a.process.kill9()
    _kill(a_pids)

    async def abnormal() -> bool:
        return (await _condition(b, vid)).abnormal

    await until(abnormal, lambda: f"node-b reporting the copy abnormal; log:\n{b.process.log()[-3000:]}", 60,
                interval=0.5)
    await a.process.start(timeout=60)

    await until(lambda: _local(b, vid), lambda: f"the copy done; node-b log:\n{b.process.log()[-4000:]}", 120,
                interval=0.5)

    # Whole, byte for byte, standing alone; and node A's lease is gone, so its snapshot can go.
    assert await asyncio.to_thread(_read, target, 0, SIZE) == data
    local_copy = next((b.box.state_dir / "pool").glob("*-copy.qcow2"))
    _, info = await run(bundled("qemu-img"), "info", "-U", "--output=json", str(local_copy))
    assert "backing-filename" not in info, info
    await until(lambda: _lease_gone(a, snapshot), "node-a's lease released", 30, interval=0.5)
    assert not _copy_servers(a.box)


async def _local(node: Node, volume_id: str) -> bool:
    """The volume no longer reads through another node: healthy, and no copy under way."""
    condition = await _condition(node, volume_id)
    return not condition.abnormal and "copied" not in condition.message


async def _progress(node: Node, volume_id: str, percent: int) -> bool:
    message = (await _condition(node, volume_id)).message
    if "being copied" not in message or "%" not in message:
        return False
    done = int(message.rsplit("(", 1)[1].split("%")[0])
    return done >= percent and done < 95


async def _lease_gone(node: Node, snapshot_id: str) -> bool:
    try:
        await node.csi.delete_snapshot(snapshot_id)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        return False
    return True


async def test_clone_of_a_volume_on_another_node(pair: Pair) -> None:
    a, b = pair.a, pair.b
    data = _pattern(7)
    source_vid, _ = await _block_volume(a, "origin", data, keep_staged=False)
    clone = await b.csi.create_volume("clone", SIZE, block=True, from_volume=source_vid)
    code, message = await _code(a.csi.delete_volume(source_vid))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and clone.volume_id in message and "node-b" in message, message
    code, message = await _code(b.csi.create_volume("nowhere", SIZE, block=True,
                                                    from_snapshot="snap-" + "0" * 24))
    assert code == grpc.StatusCode.NOT_FOUND, message

    await until(lambda: _local(b, clone.volume_id), lambda: f"the clone done; node-b log:\n{b.process.log()[-4000:]}",
                60, interval=0.5)
    staging, target = b.box.staging(clone.volume_id), b.box.target(clone.volume_id)
    await _as_the_co(lambda: b.csi.stage(clone.volume_id, str(staging), block=True))
    await _as_the_co(lambda: b.csi.publish(clone.volume_id, str(staging), str(target), block=True))
    assert await asyncio.to_thread(_read, target, 0, SIZE) == data
    await until(lambda: _deleted(a, source_vid), "the origin deletable once the clone is local", 30, interval=0.5)


async def _deleted(node: Node, volume_id: str) -> bool:
    try:
        await node.csi.delete_volume(volume_id)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        return False
    return True


@dataclasses.dataclass(frozen=True)
class _Restore:
    data: bytes  # the snapshot's content
    snapshot: str  # on node A
    vid: str  # its restore on node B, not staged
    other_vid: str  # another volume of node B, staged and published at `other`, holding `other_data`
    other: Path
    other_data: bytes


async def _restore_beside_another(pair: Pair, seed: int, other_seed: int) -> _Restore:
    """A snapshot on node A of a volume not staged there, its restore on node B, and another volume in use on B."""
    data = _pattern(seed)
    source_vid, _ = await _block_volume(pair.a, "source", data, keep_staged=False)
    snapshot = (await pair.a.csi.create_snapshot("snap", source_vid)).snapshot_id
    other_data = _pattern(other_seed)[:4 * MIB]
    other_vid, other = await _block_volume(pair.b, "other", other_data)
    vid = (await pair.b.csi.create_volume("restored", SIZE, block=True, from_snapshot=snapshot)).volume_id
    return _Restore(data, snapshot, vid, other_vid, other, other_data)


def _served_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--port") + 1])


async def _as_the_co_until_up(call: Callable[[], Awaitable[None]], timeout: float, *nodes: Node) -> None:
    """Retry a call answered ABORTED or UNAVAILABLE, as kubelet does, for up to `timeout` seconds; a failure shows
    the end of each of `nodes`' logs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await call()
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE) or loop.time() > deadline:
                logs = "".join(f"\n{node.name} log:\n{node.process.log()[-4000:]}" for node in nodes)
                raise AssertionError(f"{exc.code().name} for {timeout:.0f}s: {exc.details()}{logs}") from exc
        await asyncio.sleep(0.5)


async def test_a_stage_while_the_source_is_down_answers_at_once_and_the_source_may_come_back_elsewhere(
        pair: Pair) -> None:
    """The source's NBD server gone and its port held by something that accepts but never speaks (QEMU
    would wait its whole open-timeout there, with QSD's monitor silent): a stage on the target answers
    UNAVAILABLE naming the source at once, QSD lives on serving the other volumes, and the source, back
    on another port, is found again by the copy without help."""
    a, b = pair.a, pair.b
    r = await _restore_beside_another(pair, 23, 29)
    data, snapshot, vid, other, other_data = r.data, r.snapshot, r.vid, r.other, r.other_data

    # Node A goes down, and something else takes its copy port; B's QSD restarts, so nothing of the copy is open.
    async with _down_with_its_port_taken(a) as port:
        qsd = await _qsd_replaced(b, other, other_data)

        loop = asyncio.get_running_loop()
        staging, target = b.box.staging(vid), b.box.target(vid)
        deadline = loop.time() + 20
        while True:
            started = loop.time()
            code, message = await _code(b.csi.stage(vid, str(staging), block=True))
            waited = loop.time() - started
            # The fill holds the volume a moment at times (longer on a loaded machine): the CO retries.
            if code != grpc.StatusCode.ABORTED or loop.time() > deadline:
                break
            await asyncio.sleep(0.2)
        assert code == grpc.StatusCode.UNAVAILABLE and "node node-a" in message and str(port) in message, message
        assert waited < 3, f"the refused stage took {waited:.1f}s"
        # QSD answered throughout: the same process, never declared wedged, serving the other volume.
        assert qsd_pids(b.box.state_dir) == qsd
        assert "qsd_wedged" not in b.process.log()
        assert await asyncio.to_thread(_read, other, 0, 4 * MIB) == other_data

        # A comes back, its port still taken: it serves the lease on another port, and B follows.
        await a.process.start(timeout=60)
        # The copy finds the new port on its next retry (its back-off tops out at 8 s, a refused probe takes 3 s,
        # and A starts a new copy server when asked): slower while the machine is busy, as under CI's builds.
        await _as_the_co_until_up(lambda: b.csi.stage(vid, str(staging), block=True), 120, a, b)
        await _as_the_co(lambda: b.csi.publish(vid, str(staging), str(target), block=True))
        assert "event=copy_lease_moved" in a.process.log()
        assert "event=copy_source_moved" in b.process.log()
        await until(lambda: _local(b, vid), lambda: f"the copy done; node-b log:\n{b.process.log()[-4000:]}", 120,
                    interval=0.5)
        assert await asyncio.to_thread(_read, target, 0, SIZE) == data
        assert qsd_pids(b.box.state_dir) == qsd
        await until(lambda: _lease_gone(a, snapshot), "node-a's lease released", 30, interval=0.5)


@contextlib.asynccontextmanager
async def _down_with_its_port_taken(node: Node) -> AsyncIterator[int]:
    """The node's driver, QSD and (only) copy server killed, and the server's port held by a listener that
    accepts but never speaks; yields the port."""
    (server,) = _copy_servers(node.box)
    port = _served_port(server)
    await node.process.kill9()
    _kill(qsd_pids(node.box.state_dir) + [server])
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await until(lambda: _bound(squatter, port), f"port {port} free", 10, interval=0.1)
        squatter.listen(8)
        yield port


async def _qsd_replaced(node: Node, other: Path, other_data: bytes) -> list[int]:
    """SIGKILL the node's QSD; once its successor serves the volume at `other` again, its pids."""
    old = qsd_pids(node.box.state_dir)
    _kill(old)
    await until(lambda: qsd_pids(node.box.state_dir) not in ([], old), f"{node.name}'s QSD back", 30, interval=0.2)
    await until(lambda: _reads(other, other_data), f"{node.name}'s other volume served again", 30, interval=0.2)
    return qsd_pids(node.box.state_dir)


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def _reads(device: Path, data: bytes) -> bool:
    try:
        return _read(device, 0, len(data)) == data
    except OSError:
        return False


async def test_a_staged_copy_whose_source_is_down_when_qsd_restarts_is_served_again_once_the_source_is_back(
        pair: Pair) -> None:
    """B's QSD dies while node A, the source of a staged copy, is down: the rebuild cannot open the copy (and
    must not wait for A with QSD's monitor), so the volume stays staged without its export. Kubelet sends no
    new stage; the driver retries by itself, reports the volume abnormal meanwhile, keeps QSD and B's other
    volume serving, and serves the copy again at its target once A is back, where the copy then finishes."""
    a, b = pair.a, pair.b
    r = await _restore_beside_another(pair, 31, 37)
    data, snapshot, vid, other_vid, other, other_data = r.data, r.snapshot, r.vid, r.other_vid, r.other, r.other_data
    staging, target = b.box.staging(vid), b.box.target(vid)
    await _as_the_co(lambda: b.csi.stage(vid, str(staging), block=True))
    await _as_the_co(lambda: b.csi.publish(vid, str(staging), str(target), block=True))
    assert await asyncio.to_thread(_read, target, SIZE - MIB, MIB) == data[SIZE - MIB:]
    await until(lambda: _progress(b, vid, 5), "the copy under way", 30, interval=0.2)

    # Node A goes down (driver, QSD, NBD server), then B's QSD is SIGKILLed and replaced.
    a_pids = qsd_pids(a.box.state_dir) + _copy_servers(a.box)
    await a.process.kill9()
    _kill(a_pids)
    qsd = await _qsd_replaced(b, other, other_data)

    async def stalled() -> pb.VolumeCondition | None:
        condition = await _condition(b, vid)
        return condition if condition.abnormal and "not served" in condition.message else None

    condition = await until(stalled, lambda: f"node-b reporting the copy stalled; log:\n{b.process.log()[-3000:]}",
                            30, interval=0.3)
    assert condition is not None and "node node-a" in condition.message and "retries" in condition.message, condition
    listed = {e.volume.volume_id: e.status.volume_condition for e in await b.csi.list_volume_entries()}
    assert listed[vid].abnormal and "node node-a" in listed[vid].message, listed[vid]
    assert not listed[other_vid].abnormal, listed[other_vid]
    stats = await b.csi.stats(vid, str(target))
    assert stats.volume_condition.abnormal and "node node-a" in stats.volume_condition.message, stats
    # Retried without wedging QSD: several rounds later it is the same process, serving the other volume.
    assert "event=rebuild_stalled" in b.process.log()
    await until(lambda: _retried(b, vid, 2), "two retries while node-a is down", 30, interval=0.3)
    assert qsd_pids(b.box.state_dir) == qsd
    assert "qsd_wedged" not in b.process.log()
    assert await asyncio.to_thread(_read, other, 0, 4 * MIB) == other_data

    # A comes back: B's copy is served again at its target without any call, healthy, and finishes.
    await a.process.start(timeout=60)
    await until(lambda: _reads(target, data[:MIB]), lambda: f"the copy served again at {target}; node-b log:\n"
                f"{b.process.log()[-4000:]}", 60, interval=0.5)
    assert "event=rebuild_retried" in b.process.log()
    assert await asyncio.to_thread(_read, target, 0, SIZE) == data
    condition = await _condition(b, vid)
    assert "not served" not in condition.message, condition
    stats = await b.csi.stats(vid, str(target))
    assert not stats.volume_condition.abnormal, stats
    await until(lambda: _local(b, vid), lambda: f"the copy done; node-b log:\n{b.process.log()[-4000:]}", 120,
                interval=0.5)
    assert await asyncio.to_thread(_read, target, 0, SIZE) == data
    assert qsd_pids(b.box.state_dir) == qsd
    assert "qsd_wedged" not in b.process.log()
    await until(lambda: _lease_gone(a, snapshot), "node-a's lease released", 30, interval=0.5)


async def _retried(node: Node, volume_id: str, count: int) -> bool:
    """The driver retried the stalled volume at least `count` times (its condition counts them)."""
    message = (await _condition(node, volume_id)).message
    return "retried " in message and int(message.split("retried ", 1)[1].split()[0]) >= count


async def test_a_staged_copy_whose_source_came_back_on_another_port_follows_it_once_qsd_restarts(
        pair: Pair) -> None:
    """A staged copy reads through the address its link was opened with; once B's QSD restarts, the rebuild
    stalls on the old address (something else holds it), the copy learns the new one, and the volume is
    served again from there without any call."""
    a, b = pair.a, pair.b
    r = await _restore_beside_another(pair, 41, 43)
    staging, target = b.box.staging(r.vid), b.box.target(r.vid)
    await _as_the_co(lambda: b.csi.stage(r.vid, str(staging), block=True))
    await _as_the_co(lambda: b.csi.publish(r.vid, str(staging), str(target), block=True))
    async with _down_with_its_port_taken(a):
        await a.process.start(timeout=60)
        await _qsd_replaced(b, r.other, r.other_data)
        await until(lambda: _reads(target, r.data[:MIB]), lambda: f"the copy served again at {target}; node-b log:\n"
                    f"{b.process.log()[-4000:]}", 60, interval=0.5)
        assert "event=copy_source_moved" in b.process.log()
        assert await asyncio.to_thread(_read, target, 0, SIZE) == r.data
        await until(lambda: _local(b, r.vid), lambda: f"the copy done; node-b log:\n{b.process.log()[-4000:]}", 120,
                    interval=0.5)
        assert "qsd_wedged" not in b.process.log()


async def test_only_the_node_a_copy_is_for_may_lease_release_or_read_it(pair: Pair, tmp_path: Path) -> None:
    """Node C holds a valid certificate of the same CA and is one of A's peers, yet it may not lease B's copy
    (for B, or for itself), release it, nor read the export A serves B; nor may a certificate of the CA whose
    OU holds `x,CN=node-b`; the router's certificate and one that names no peer are refused on the copy
    service altogether. B's copy goes on untouched and finishes."""
    a, b, pki = pair.a, pair.b, pair.pki
    data = _pattern(47)
    source_vid, _ = await _block_volume(a, "source", data, keep_staged=False)
    snapshot = (await a.csi.create_snapshot("snap", source_vid)).snapshot_id
    vid = (await b.csi.create_volume("restored", SIZE, block=True, from_snapshot=snapshot)).volume_id
    (server,) = _copy_servers(a.box)
    export_address = f"127.0.0.1:{_served_port(server)}"
    source = f"snapshot:{snapshot}"

    c = pki.for_node("node-c")
    code, message = await copies_call(a.address, c, "Lease", {"source": source, "copy_volume_id": vid,
                                                               "node": "node-b"})
    assert code == grpc.StatusCode.PERMISSION_DENIED and "node-c" in message and "node-b" in message, message
    code, message = await copies_call(a.address, c, "Lease", {"source": source, "copy_volume_id": vid,
                                                               "node": "node-c"})
    assert code == grpc.StatusCode.PERMISSION_DENIED and "node-c" in message and "node-b" in message, message
    code, message = await copies_call(a.address, c, "Release", {"copy_volume_id": vid, "node": "node-c"})
    assert code == grpc.StatusCode.PERMISSION_DENIED and "node-c" in message and "node-b" in message, message
    for name, files in ((ROUTER_NAME, pki.router), ("intruder", pki.for_node("intruder"))):
        code, message = await copies_call(a.address, files, "Lease", {"source": source, "copy_volume_id": vid,
                                                                       "node": name})
        assert code == grpc.StatusCode.PERMISSION_DENIED and name in message, message

    # A's NBD server lets B's certificate in, and no other of the CA's.
    ok, _ = await _nbd_info(export_address, vid, pki.for_node("node-b"), tmp_path / "tls-b")
    assert ok
    ok, error = await _nbd_info(export_address, vid, c, tmp_path / "tls-c")
    assert not ok, "node C read the export A serves node B"
    # Nor one whose subject merely contains B's name (GnuTLS writes it `CN=intruder,OU=x\,CN=node-b`).
    ok, error = await _nbd_info(export_address, vid, crafted_intruder(pki), tmp_path / "tls-intruder")
    assert not ok, "a certificate with OU 'x,CN=node-b' read the export A serves node B"

    await _whole_and_released((a, b), vid, snapshot, data)


def _key_files(node: Node, keys: list[bytes]) -> list[str]:
    """Files of `node`'s state and runtime directories that hold one of `keys` (a private key's PEM bytes)."""
    found = []
    for root in (node.box.state_dir, node.box.runtime_dir):
        for path in root.rglob("*") if root.exists() else ():
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink() and path.stat().st_size < MIB and any(
                        key in path.read_bytes() for key in keys):
                    found.append(str(path))
    return found


async def test_no_private_key_stays_on_disk_once_a_copy_is_set_up(pair: Pair) -> None:
    """QEMU's copies of the node's TLS files (qemu-nbd serving A's snapshot, QSD's `cqpeer-tls` on B) live in the
    runtime directory only while QEMU loads them: with the copy set up (A serving, B's QSD linked), neither node
    holds a file with a private key in its state or runtime directory; the copies earlier versions kept in
    state/copies/tls-* are removed when the driver starts."""
    a, b, pki = pair.a, pair.b, pair.pki
    keys = [pki.for_node(name).key.read_bytes() for name in ("node-a", "node-b")]
    data = _pattern(53)
    source_vid, _ = await _block_volume(a, "source", data, keep_staged=False)
    snapshot = (await a.csi.create_snapshot("snap", source_vid)).snapshot_id
    vid = (await b.csi.create_volume("restored", SIZE, block=True, from_snapshot=snapshot)).volume_id
    await until(lambda: "event=copy_tls_loaded" in b.process.log(), "node-b's QSD loaded its TLS client object", 60,
                interval=0.2)
    assert _copy_servers(a.box), "node-a serves the copy"
    assert _key_files(a, keys) == [] and _key_files(b, keys) == []
    for node in (a, b):
        assert sorted(p.name for p in node.box.runtime_dir.iterdir()) == []
        assert node.box.runtime_dir.stat().st_mode & 0o777 == 0o700

    # What an earlier version left: the key copied into the state directory, removed at start.
    legacy = a.box.state_dir / "copies" / "tls-server"
    legacy.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(pki.for_node("node-a").key, legacy / "server-key.pem")
    await a.process.stop()
    await a.process.start(timeout=60)
    assert not legacy.exists() and _key_files(a, keys) == []
    await _whole_and_released((a, b), vid, snapshot, data)
    assert _key_files(a, keys) == [] and _key_files(b, keys) == []


async def _nbd_info(address: str, export: str, files: PemFiles, directory: Path) -> tuple[bool, str]:
    """Whether `qemu-img info` opens the NBD export at `address` presenting `files`; its error otherwise."""
    opened, out, err = await nbd_info(address, export, files, directory)
    return opened and f"virtual size: {SIZE >> 20} MiB" in out, err


@pytest.fixture
async def short_leases(tmp_path: Path) -> AsyncIterator[Pair]:
    """A pair whose source drops a lease its copy has not asked for in TTL seconds."""
    async with _pair(tmp_path, "--copy-lease-ttl", str(TTL)) as pair:
        yield pair


TTL = 4  # seconds; the restore below streams for ~16 s


async def test_a_streaming_copy_keeps_its_lease_and_an_operator_can_drop_one(short_leases: Pair) -> None:
    """A copy streaming four times longer than the source's lease TTL renews its lease and finishes whole.
    Meanwhile A's operator lists A's leases and drops another copy's: that copy reports itself lost (never
    finished from anything else), the drop is listed until the operator lifts it (`lift-lease`), A's volume
    it cloned can be deleted, and so can the lost copy's volume."""
    a, b = short_leases.a, short_leases.b
    data = _pattern(53)
    source_vid, _ = await _block_volume(a, "source", data, keep_staged=False)
    snapshot = (await a.csi.create_snapshot("snap", source_vid)).snapshot_id
    vid = (await b.csi.create_volume("restored", SIZE, block=True, from_snapshot=snapshot)).volume_id
    other_vid, _ = await _block_volume(a, "other", data[:MIB], keep_staged=False)
    clone = (await b.csi.create_volume("clone", SIZE, block=True, from_volume=other_vid)).volume_id

    code, out, err = await csi_qsd("volume", "--endpoint", a.box.endpoint, "leases", "-o", "json")
    assert code == 0, err
    listed = {lease["copy_volume_id"]: lease for lease in map(json.loads, out.splitlines())}
    assert set(listed) == {vid, clone} and listed[clone]["node"] == "node-b", listed
    code, _, err = await csi_qsd("volume", "--endpoint", a.box.endpoint, "drop-lease", clone)
    assert code == 0 and clone in err, err

    async def lost() -> bool:
        condition = await _condition(b, clone)
        return condition.abnormal and "lost" in condition.message and "node-a" in condition.message

    await until(lost, lambda: f"the dropped copy reported lost; node-a log:\n{_copy_lines(a)}\nnode-b log:\n"
                f"{_copy_lines(b)}", 60, interval=0.5)
    code, out, err = await csi_qsd("volume", "--endpoint", a.box.endpoint, "leases", "-o", "json")
    assert code == 0 and {lease["copy_volume_id"]: lease["state"] for lease in map(json.loads, out.splitlines())
                          }.get(clone) == "revoked", out
    code, _, err = await csi_qsd("volume", "--endpoint", a.box.endpoint, "lift-lease", vid)
    assert code != 0 and "NOT_FOUND" in err and vid in err, err  # only a drop is lifted
    code, _, err = await csi_qsd("volume", "--endpoint", a.box.endpoint, "lift-lease", clone)
    assert code == 0 and clone in err, err
    await until(lambda: _deleted(a, other_vid), "the cloned volume deletable once its lease is dropped", 30,
                interval=0.5)
    await b.csi.delete_volume(clone)

    await _whole_and_released((a, b), vid, snapshot, data)
    assert "event=copy_lease_expired" not in a.process.log()
    assert a.process.log().count("rpc=CopyLease ") >= 4, "the copy renewed its lease while it streamed"



async def _whole_and_released(nodes: tuple[Node, Node], vid: str, snapshot: str, data: bytes) -> None:
    """B's copy `vid` of A's `snapshot` finishes, holds `data` once staged and published, and A's lease goes."""
    a, b = nodes
    await until(lambda: _local(b, vid), lambda: f"the copy done; node-b log:\n{b.process.log()[-4000:]}", 120,
                interval=0.5)
    staging, target = b.box.staging(vid), b.box.target(vid)
    await _as_the_co(lambda: b.csi.stage(vid, str(staging), block=True))
    await _as_the_co(lambda: b.csi.publish(vid, str(staging), str(target), block=True))
    assert await asyncio.to_thread(_read, target, 0, SIZE) == data
    await until(lambda: _lease_gone(a, snapshot), "node-a's lease released by node-b", 30, interval=0.5)


def _copy_lines(node: Node) -> str:
    """What a node's log says about copies (its last 60 such lines)."""
    return "\n".join([line for line in node.process.log().splitlines()
                      if "event=copy" in line or "rpc=Copy" in line or "Traceback" in line][-60:])
