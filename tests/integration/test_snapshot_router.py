"""The snapshot-metadata router in front of two real node plugins, over mutual TLS.

Two `csi-qsd serve` processes act as two nodes (own state dirs, own QSD,
own metadata listener); `csi-qsd snapshot-metadata-router` runs as a third
process with a static node map, as the sidecar's CSI endpoint. Each node
holds a block volume with data written before and between two snapshots.
Through the router every answer must equal, message for message, what the
owning node answers on its own socket; errors keep their codes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.router.config import DEFAULT_SERVER_NAME
from csi_qsd.transport.tls import PemFiles, channel_credentials
from testing.certs import Pki, mint
from testing.harness import until
from testing.router_cluster import Node, Router, node_plugin

MIB = 1 << 20
SIZE = 64 * MIB


def _write(device: Path, offset: int, length: int, seed: int) -> None:
    fd = os.open(device, os.O_WRONLY)
    try:
        assert os.pwrite(fd, bytes([seed]) * length, offset) == length
        os.fsync(fd)
    finally:
        os.close(fd)


async def _fill(node: Node, seed: int) -> None:
    """A block volume with scattered writes, snapshotted twice with more writes in between."""
    vid = (await node.csi.create_volume(f"pvc-{node.name}", SIZE, block=True)).volume_id
    staging, target = node.box.staging(vid), node.box.target(vid)
    await node.csi.stage(vid, str(staging), block=True)
    await node.csi.publish(vid, str(staging), str(target), block=True)
    for i in range(6):
        await asyncio.to_thread(_write, target, (i * 7 + seed) * MIB + 4096 * i, 96 * 1024, seed + i)
    node.snapshots.append((await node.csi.create_snapshot(f"s1-{node.name}", vid)).snapshot_id)
    for i in range(4):
        await asyncio.to_thread(_write, target, (i * 11 + seed + 3) * MIB, 200 * 1024, seed + 10 + i)
    node.snapshots.append((await node.csi.create_snapshot(f"s2-{node.name}", vid)).snapshot_id)


@dataclasses.dataclass
class Cluster:
    pki: Pki
    nodes: list[Node]
    router: Router
    routed: CSIClient


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    pki = mint(tmp_path / "pki")
    async with node_plugin("node-a", pki) as a, node_plugin("node-b", pki) as b:
        await asyncio.gather(_fill(a, 1), _fill(b, 2))
        router = Router(tmp_path, pki.router, [a, b])
        try:
            routed = await router.start()
            async with routed:
                yield Cluster(pki, [a, b], router, routed)
        finally:
            await router.stop()


async def _messages(call: Any) -> list[Any]:
    return [message async for message in call]


async def _outcome(call: Callable[[], Any]) -> list[Any] | tuple[grpc.StatusCode, str]:
    """Every message of a stream, or its error's code and message."""
    try:
        return await _messages(call())
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""


def _requests(node: Node) -> list[tuple[str, Any]]:
    s1, s2 = node.snapshots
    allocated = pb.GetMetadataAllocatedRequest
    delta = pb.GetMetadataDeltaRequest
    return [
        ("GetMetadataAllocated", allocated(snapshot_id=s1)),
        ("GetMetadataAllocated", allocated(snapshot_id=s2, max_results=1)),
        ("GetMetadataAllocated", allocated(snapshot_id=s2, starting_offset=20 * MIB + 12345, max_results=2)),
        ("GetMetadataDelta", delta(base_snapshot_id=s1, target_snapshot_id=s2)),
        ("GetMetadataDelta", delta(base_snapshot_id=s1, target_snapshot_id=s2, max_results=1)),
        ("GetMetadataDelta", delta(base_snapshot_id=s1, target_snapshot_id=s2, starting_offset=9 * MIB)),
    ]


async def test_router_answers_as_the_owning_node(cluster: Cluster) -> None:
    for node in cluster.nodes:
        for method, request in _requests(node):
            direct = await _messages(getattr(node.csi.metadata, method)(request, timeout=30))
            routed = await _messages(getattr(cluster.routed.metadata, method)(request, timeout=30))
            assert routed == direct, f"{node.name} {method} {request}"
            assert sum(len(m.block_metadata) for m in direct) > 0, f"{node.name} {method}: the test wrote nothing?"
            if request.max_results == 1:
                assert len(routed) > 1, "several messages, passed through one by one"
    info = await cluster.routed.plugin_info()
    assert info.name == "csi-qsd.io"
    caps = await cluster.routed.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=10)
    assert [c.service.type for c in caps.capabilities] == [pb.PluginCapability.Service.SNAPSHOT_METADATA_SERVICE]


async def test_errors_pass_through_with_their_codes(cluster: Cluster) -> None:
    a, b = cluster.nodes
    a1, a2 = a.snapshots
    unknown = f"snap-{uuid.uuid4().hex[:24]}"
    node_errors = [
        ("GetMetadataDelta", pb.GetMetadataDeltaRequest(base_snapshot_id=a2, target_snapshot_id=a1)),
        ("GetMetadataAllocated", pb.GetMetadataAllocatedRequest(snapshot_id=a1, starting_offset=SIZE + 1)),
        ("GetMetadataAllocated", pb.GetMetadataAllocatedRequest(snapshot_id=a1, max_results=-1)),
    ]
    for method, request in node_errors:
        direct = await _outcome(lambda: getattr(a.csi.metadata, method)(request, timeout=30))
        routed = await _outcome(lambda: getattr(cluster.routed.metadata, method)(request, timeout=30))
        assert isinstance(direct, tuple) and isinstance(routed, tuple), (direct, routed)
        assert routed[0] == direct[0] and direct[1] in routed[1] and "node-a" in routed[1], (direct, routed)

    metadata = cluster.routed.metadata
    router_errors: list[tuple[Callable[[], Any], grpc.StatusCode, str]] = [
        (lambda: metadata.GetMetadataAllocated(pb.GetMetadataAllocatedRequest(snapshot_id=unknown)),
         grpc.StatusCode.NOT_FOUND, unknown),
        (lambda: metadata.GetMetadataAllocated(pb.GetMetadataAllocatedRequest(snapshot_id="pvc-123")),
         grpc.StatusCode.NOT_FOUND, "pvc-123"),
        (lambda: metadata.GetMetadataAllocated(pb.GetMetadataAllocatedRequest()),
         grpc.StatusCode.INVALID_ARGUMENT, "snapshot_id"),
        (lambda: metadata.GetMetadataDelta(pb.GetMetadataDeltaRequest(base_snapshot_id=a1, target_snapshot_id=unknown)),
         grpc.StatusCode.NOT_FOUND, unknown),
        (lambda: metadata.GetMetadataDelta(pb.GetMetadataDeltaRequest(
            base_snapshot_id=a1, target_snapshot_id=b.snapshots[1])), grpc.StatusCode.INVALID_ARGUMENT, "node-b"),
    ]
    for call, code, named in router_errors:
        outcome = await _outcome(call)
        assert isinstance(outcome, tuple) and outcome[0] == code and named in outcome[1], (code, outcome)


def _listener(address: str, tls: PemFiles) -> grpc.aio.Channel:
    """A channel to a node plugin's metadata listener, presenting `tls`' certificate."""
    options = (("grpc.ssl_target_name_override", DEFAULT_SERVER_NAME),)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)


async def _allocated(channel: grpc.aio.Channel, snapshot_id: str) -> list[Any] | tuple[grpc.StatusCode, str]:
    stub = pb_grpc.SnapshotMetadataStub(channel)
    return await _outcome(lambda: stub.GetMetadataAllocated(
        pb.GetMetadataAllocatedRequest(snapshot_id=snapshot_id), timeout=10))


async def test_only_the_clusters_certificates_get_in(cluster: Cluster) -> None:
    a = cluster.nodes[0]
    s1 = a.snapshots[0]
    expected = await _messages(a.csi.metadata.GetMetadataAllocated(pb.GetMetadataAllocatedRequest(snapshot_id=s1)))
    async with _listener(a.address, cluster.pki.router) as channel:
        assert await _allocated(channel, s1) == expected
        # The listener offers nothing that changes a volume.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.ControllerStub(channel).DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=s1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    stranger = cluster.pki.stranger
    async with _listener(a.address, stranger) as channel:
        outcome = await _allocated(channel, s1)
        assert isinstance(outcome, tuple) and outcome[0] == grpc.StatusCode.UNAVAILABLE, outcome
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=cluster.pki.node.ca.read_bytes())
    async with grpc.aio.secure_channel(a.address, no_client_cert,
                                       options=(("grpc.ssl_target_name_override", DEFAULT_SERVER_NAME),)) as channel:
        outcome = await _allocated(channel, s1)
        assert isinstance(outcome, tuple) and outcome[0] == grpc.StatusCode.UNAVAILABLE, outcome
    assert (await a.csi.metadata_allocated(s1))[1], "the node still answers its own socket"

    # A router holding the stranger's certificate reaches no node.
    wrong = Router(cluster.router.log_path.parent / "wrong", stranger, cluster.nodes)
    wrong.log_path.parent.mkdir()
    try:
        async with await wrong.start() as routed:
            outcome = await _outcome(lambda: routed.metadata.GetMetadataAllocated(
                pb.GetMetadataAllocatedRequest(snapshot_id=s1), timeout=30))
            assert isinstance(outcome, tuple) and outcome[0] == grpc.StatusCode.UNAVAILABLE, outcome
            assert "node-a" in outcome[1] and "node-b" in outcome[1], outcome
    finally:
        await wrong.stop()


async def test_a_node_down_is_unavailable_and_back_when_it_is(cluster: Cluster) -> None:
    a, b = cluster.nodes
    routed = cluster.routed
    b_snapshot = b.snapshots[1]
    before = await routed.metadata_allocated(b_snapshot)  # the router now knows where it is
    await b.process.kill9()

    async def code_of(call: Callable[[], Awaitable[object]]) -> grpc.StatusCode | None:
        try:
            await call()
        except grpc.aio.AioRpcError as exc:
            assert "node-b" in (exc.details() or ""), exc.details()
            return exc.code()
        return None

    assert await code_of(lambda: routed.metadata_allocated(b_snapshot)) == grpc.StatusCode.UNAVAILABLE
    unknown = f"snap-{uuid.uuid4().hex[:24]}"  # on node-a it is not; node-b cannot be asked
    assert await code_of(lambda: routed.metadata_allocated(unknown)) == grpc.StatusCode.UNAVAILABLE
    assert await code_of(lambda: routed.metadata_delta(a.snapshots[0], b_snapshot)) == grpc.StatusCode.UNAVAILABLE
    assert (await routed.metadata_allocated(a.snapshots[1]))[1], "node-a keeps answering"

    await b.process.start()

    async def answers_again() -> bool:
        try:
            return await routed.metadata_allocated(b_snapshot) == before
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False

    await until(answers_again, lambda: f"node-b through the router again; router log:\n{cluster.router.log()[-3000:]}",
                30, interval=0.2)
