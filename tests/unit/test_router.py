"""The router's settings, node discovery and owner lookup, and the TLS listener's certificate reload.

A small in-process gRPC server stands in for the node plugins: it answers
GetSnapshot from a set of IDs over mutual TLS, so these run without QSD.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli import build_parser
from csi_qsd.config import Config
from csi_qsd.csi.identity import IdentityService
from csi_qsd.csi.metadata_listener import serving_metadata_listener
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import NotFound, Unavailable
from csi_qsd.router.config import NodeAddress, RouterConfig
from csi_qsd.router.nodes import Node, NodeDirectory
from csi_qsd.router.owners import Owners
from csi_qsd.transport.tls import ROUTER_NAME, PemFiles, channel_credentials, server_credentials
from testing.certs import Authority, mint
from testing.harness import free_port, until

HELD = "snap-" + "a" * 24


@pytest.mark.parametrize("text", ["node-1=10.0.0.1:9811", "n.example=[fd00::1]:9811", "a=host.svc:1"])
def test_node_address_parses(text: str) -> None:
    node = NodeAddress.parse(text)
    assert f"{node.name}={node.address}" == text


@pytest.mark.parametrize("text", ["10.0.0.1:9811", "Node=1.2.3.4:1", "n=1.2.3.4", "n=1.2.3.4:0", "n=1.2.3.4:70000",
                                  "n=host:port", "=1.2.3.4:1"])
def test_node_address_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--node"):
        NodeAddress.parse(text)


def test_router_config_needs_one_node_source(tmp_path: Path) -> None:
    tls = PemFiles(tmp_path / "c", tmp_path / "k", tmp_path / "ca")
    node = NodeAddress.parse("a=127.0.0.1:1")
    with pytest.raises(ValueError, match="either"):
        RouterConfig("unix:///x.sock", tls)
    with pytest.raises(ValueError, match="either"):
        RouterConfig("unix:///x.sock", tls, nodes=(node,), nodes_dns="h:1")
    with pytest.raises(ValueError, match="unique"):
        RouterConfig("unix:///x.sock", tls, nodes=(node, node))
    with pytest.raises(ValueError, match="unix://"):
        RouterConfig("tcp://x:1", tls, nodes=(node,))
    with pytest.raises(ValueError, match="HOST:PORT"):
        RouterConfig("unix:///x.sock", tls, nodes_dns="no-port")


async def test_dns_names_every_address(tmp_path: Path) -> None:
    pki = mint(tmp_path)
    directory = NodeDirectory(RouterConfig("unix:///x.sock", pki.router, nodes_dns="localhost:9811"))
    try:
        nodes = await directory.nodes()
        assert Node("127.0.0.1", "127.0.0.1:9811") in nodes
        assert all(n.address in ("127.0.0.1:9811", "[::1]:9811") for n in nodes)
    finally:
        await directory.close()
    unresolvable = NodeDirectory(RouterConfig("unix:///x.sock", pki.router, nodes_dns="no-such-host.invalid:1"))
    with pytest.raises(Unavailable, match="no-such-host.invalid"):
        await unresolvable.nodes()


class _Holder(pb_grpc.ControllerServicer):
    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.asked = 0

    async def GetSnapshot(self, request: pb.GetSnapshotRequest, context: grpc.aio.ServicerContext) -> object:
        self.asked += 1
        if request.snapshot_id not in self.held:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"snapshot {request.snapshot_id} does not exist")
        return pb.GetSnapshotResponse(snapshot=pb.Snapshot(snapshot_id=request.snapshot_id))


@contextlib.asynccontextmanager
async def _node(files: PemFiles, held: set[str]) -> AsyncIterator[tuple[str, _Holder]]:
    server = grpc.aio.server()
    holder = _Holder(held)
    pb_grpc.add_ControllerServicer_to_server(holder, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_secure_port(address, server_credentials(files))
    await server.start()
    try:
        yield address, holder
    finally:
        await server.stop(None)


async def test_owner_found_cached_and_forgotten(tmp_path: Path) -> None:
    pki = mint(tmp_path)
    async with _node(pki.node, set()) as (a, holder_a), _node(pki.node, {HELD}) as (b, holder_b):
        config = RouterConfig("unix:///x.sock", pki.router, nodes=(NodeAddress("a", a), NodeAddress("b", b)))
        directory = NodeDirectory(config)
        owners = Owners(directory, timeout=5, cache_size=1)
        try:
            assert await owners.locate(HELD) == Node("b", b)
            asked = holder_a.asked + holder_b.asked
            assert await owners.locate(HELD) == Node("b", b)
            assert holder_a.asked + holder_b.asked == asked, "a cached owner is not asked again"
            with pytest.raises(NotFound, match="2 nodes"):
                await owners.locate("snap-" + "b" * 24)
            with pytest.raises(NotFound, match="pvc-1"):
                await owners.locate("pvc-1")  # not an ID this driver issues: no node is asked
            assert await owners.locate(HELD) == Node("b", b)  # evicted by the size-1 cache, found again
        finally:
            await directory.close()
    # Both nodes gone: the snapshot may be on either.
    directory = NodeDirectory(config)
    try:
        with pytest.raises(Unavailable, match="could not ask: "):
            await Owners(directory, timeout=2, cache_size=8).locate(HELD)
    finally:
        await directory.close()


async def _held(address: str, client: PemFiles) -> bool:
    options = (("grpc.ssl_target_name_override", "csi-qsd-node"),)
    async with grpc.aio.secure_channel(address, channel_credentials(client), options=options) as channel:
        try:
            await pb_grpc.ControllerStub(channel).GetSnapshot(pb.GetSnapshotRequest(snapshot_id=HELD), timeout=5)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
        return True


async def test_listener_takes_new_certificates_without_restart(tmp_path: Path) -> None:
    """Kubelet swaps a renewed Secret's files in place: new handshakes use the new certificate and CA."""
    pki = mint(tmp_path / "old")
    live = PemFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    for source, target in zip((pki.node.cert, pki.node.key, pki.node.ca), (live.cert, live.key, live.ca)):
        shutil.copy(source, target)
    async with _node(live, {HELD}) as (address, _):
        assert await _held(address, pki.router)
        (tmp_path / "new").mkdir()
        renewed = Authority(tmp_path / "new", "renewed")
        node = renewed.issue("node", server=True)
        router = renewed.issue(ROUTER_NAME, server=False)
        for source, target in zip((node.cert, node.key, node.ca), (live.cert, live.key, live.ca)):
            shutil.copy(source, target)
        assert await _held(address, router), "a client of the new CA gets in"
        assert not await _held(address, pki.router), "the old CA's client no longer does"


async def test_listener_starts_when_its_secret_arrives(tmp_path: Path) -> None:
    """The Secret is optional in the DaemonSet: a plugin started before it serves once kubelet projects it."""
    pki = mint(tmp_path / "pki")
    live = PemFiles(tmp_path / "tls" / "tls.crt", tmp_path / "tls" / "tls.key", tmp_path / "tls" / "ca.crt")
    address = f"127.0.0.1:{free_port()}"
    config = Config(state_dir=tmp_path / "state", metadata_address=address, metadata_tls=live)
    identity = IdentityService("csi-qsd.io", lambda: True)
    async with serving_metadata_listener(config, identity, _Holder({HELD}), pb_grpc.SnapshotMetadataServicer(),
                                         check_interval=0.05):
        assert not await _held(address, pki.router)
        live.cert.parent.mkdir()
        for source, target in zip((pki.node.cert, pki.node.key, pki.node.ca), (live.cert, live.key, live.ca)):
            shutil.copy(source, target)
        await until(lambda: _held(address, pki.router), "the listener to start on the new files", 10)


def test_a_bad_node_in_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CSI_QSD_NODE", "node-a=10.0.0.1:9443 bad")
    with pytest.raises(SystemExit):
        build_parser()
    assert "CSI_QSD_NODE: --node 'bad': expected NAME=HOST:PORT" in capsys.readouterr().err
    monkeypatch.setenv("CSI_QSD_NODE", "node-a=10.0.0.1:9443")
    args = build_parser().parse_args(["snapshot-metadata-router"])
    assert [node.name for node in args.node] == ["node-a"]
