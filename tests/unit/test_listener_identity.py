"""Who a caller of the mutual-TLS listener is, and what it may read there.

Certificates are crafted per test (`testing.certs`), all of the one cluster CA:
plain per-node certificates (known by their common name) and SPIFFE ones
(known by their SPIFFE ID, with a common name that must agree). The
listener is the node plugin's own (`serving_metadata_listener`), over real
TLS, with stand-ins for the snapshots it would describe.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_qsd.config import Config
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi.metadata_listener import serving_metadata_listener
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.transport.copy_peers import StaticCopyPeers
from csi_qsd.transport.tls import ROUTER_NAME, PemFiles, channel_credentials, identity
from testing.certs import Pki, mint
from testing.harness import free_port

SNAP = "snap-" + "a" * 24
TD = "spiffe://cluster.local/ns/csi-qsd"


@pytest.mark.parametrize(("common_names", "uris", "who"), [
    (["node-b"], [], "node-b"),  # plain: the common name
    (["node-b"], [f"{TD}/csi-qsd/node/node-b"], "node-b"),
    ([], [f"{TD}/csi-qsd/node/node-b"], "node-b"),
    ([ROUTER_NAME], [f"{TD}/csi-qsd/snapshot-metadata-router"], ROUTER_NAME),
    (["node-b"], [f"{TD}/csi-qsd/node/node-c"], ""),  # the common name disagrees with the ID
    (["node-b"], ["spiffe://cluster.local/ns/team/sa/web"], ""),  # a pod named after a node, by a DNS template
    (["node-b"], ["spiffe://cluster.local/ns/team/pod/node-b"], ""),
    (["node-b"], [f"{TD}/csi-qsd/node/node-b/extra"], ""),
    (["node-b"], [f"{TD}/csi-qsd/node/node-b", f"{TD}/csi-qsd/node/node-c"], ""),  # one SPIFFE ID, not two
    (["node-b", "node-b"], [], ""),
])
def test_who_a_certificate_is(common_names: list[str], uris: list[str], who: str) -> None:
    assert identity(common_names, uris) == who


def _spiffe(pki: Pki, cn: str, spiffe_id: str, file_name: str) -> PemFiles:
    return pki.cluster.issue(cn, server=False, uris=(spiffe_id,), file_name=file_name)


class _Holder(pb_grpc.ControllerServicer):
    async def GetSnapshot(self, request: pb.GetSnapshotRequest, context: grpc.aio.ServicerContext
                          ) -> pb.GetSnapshotResponse:
        return pb.GetSnapshotResponse(snapshot=pb.Snapshot(snapshot_id=request.snapshot_id, ready_to_use=True))


class _Blocks(pb_grpc.SnapshotMetadataServicer):
    async def GetMetadataAllocated(self, request: pb.GetMetadataAllocatedRequest,
                                   context: grpc.aio.ServicerContext) -> None:
        await context.write(pb.GetMetadataAllocatedResponse(volume_capacity_bytes=1 << 20, block_metadata=[
            pb.BlockMetadata(byte_offset=0, size_bytes=65536)]))


@contextlib.asynccontextmanager
async def _listener(tmp_path: Path, pki: Pki) -> AsyncIterator[str]:
    """Node A's listener, whose peers are node-b and node-c."""
    address = f"127.0.0.1:{free_port()}"
    config = Config(state_dir=tmp_path / "state", metadata_address=address, metadata_tls=pki.for_node("node-a"))
    peers = StaticCopyPeers((("node-b", "127.0.0.1:1"), ("node-c", "127.0.0.1:1")))
    async with serving_metadata_listener(config, IdentityService("csi-qsd.io", lambda: True), _Holder(),  # type: ignore[arg-type]
                                         _Blocks(), peers=peers):  # type: ignore[arg-type]
        yield address


async def _reads(address: str, client: PemFiles) -> tuple[grpc.StatusCode, grpc.StatusCode, str]:
    """(GetSnapshot's code, GetMetadataAllocated's code, the refusal's message) for `client`."""
    options = (("grpc.ssl_target_name_override", "node-a"),)
    codes, message = [], ""
    async with grpc.aio.secure_channel(address, channel_credentials(client), options=options) as channel:
        identity_stub = pb_grpc.IdentityStub(channel)  # type: ignore[no-untyped-call]
        controller = pb_grpc.ControllerStub(channel)  # type: ignore[no-untyped-call]
        blocks = pb_grpc.SnapshotMetadataStub(channel)  # type: ignore[no-untyped-call]
        assert (await identity_stub.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=5)).name
        for call in (lambda: controller.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=SNAP), timeout=5),
                     lambda: _all(blocks.GetMetadataAllocated(pb.GetMetadataAllocatedRequest(snapshot_id=SNAP),
                                                              timeout=5))):
            try:
                await call()
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                message = exc.details() or ""
    return codes[0], codes[1], message


async def _all(stream: Any) -> list[object]:
    return [item async for item in stream]


async def test_block_maps_and_snapshots_are_for_the_router_and_peers_only(tmp_path: Path) -> None:
    """An intruder with a certificate of the same CA (a name that is no peer's) is refused GetSnapshot and
    SnapshotMetadata, naming what its certificate says; the router and a peer read; Identity answers all."""
    pki = mint(tmp_path / "pki")
    async with _listener(tmp_path, pki) as address:
        assert await _reads(address, pki.router) == (grpc.StatusCode.OK, grpc.StatusCode.OK, "")
        assert await _reads(address, pki.for_node("node-b")) == (grpc.StatusCode.OK, grpc.StatusCode.OK, "")
        for files, named in ((pki.for_node("intruder"), "'intruder'"), (pki.node, "'node'")):
            snapshot, blocks, message = await _reads(address, files)
            assert snapshot == blocks == grpc.StatusCode.PERMISSION_DENIED, message
            assert named in message and ROUTER_NAME in message


async def test_a_spiffe_identity_is_its_id_not_its_common_name(tmp_path: Path) -> None:
    """SPIRE mode: node-b's SVID and the router's read; an SVID whose DNS template made its common name a node's
    (another workload's ID), or whose common name disagrees with its node ID, is no one and is refused."""
    pki = mint(tmp_path / "pki")
    async with _listener(tmp_path, pki) as address:
        ok = (grpc.StatusCode.OK, grpc.StatusCode.OK, "")
        assert await _reads(address, _spiffe(pki, "node-b", f"{TD}/csi-qsd/node/node-b", "svid-b")) == ok
        assert await _reads(address, _spiffe(pki, ROUTER_NAME, f"{TD}/csi-qsd/snapshot-metadata-router",
                                             "svid-router")) == ok
        for cn, spiffe_id, name in (("node-b", "spiffe://cluster.local/ns/team/sa/web", "web"),
                                    ("node-b", f"{TD}/csi-qsd/node/node-x", "mixed"),
                                    (ROUTER_NAME, "spiffe://cluster.local/ns/team/sa/web", "fake-router")):
            snapshot, blocks, message = await _reads(address, _spiffe(pki, cn, spiffe_id, name))
            assert snapshot == blocks == grpc.StatusCode.PERMISSION_DENIED, (name, message)
            assert "no one of ours" in message, message
