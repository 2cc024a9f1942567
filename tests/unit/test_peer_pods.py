"""Peers from the Kubernetes API: which pods count, and the list call as an API server answers it (over HTTPS)."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_qsd.errors import Unavailable
from csi_qsd.transport.copy_peer_pods import PodCopyPeers, peers_of
from csi_qsd.transport.kube_api import InCluster
from testing.certs import mint


def _pod(node: str, ip: str, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"csi-qsd-node-{node}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T10:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase, "podIP": ip}}


def test_only_running_pods_with_a_node_and_an_ip_are_peers() -> None:
    pods = {"items": [_pod("a", "10.244.0.5"), _pod("b", "fd00::7"), _pod("c", "10.244.2.1", phase="Pending"),
                      _pod("d", "10.244.3.1", deleting=True), _pod("e", ""), _pod("", "10.244.5.1")]}
    assert peers_of(pods, 9811) == {"a": "10.244.0.5:9811", "b": "[fd00::7]:9811"}
    assert peers_of({"items": None}, 9811) == {}


class _ApiServer(http.server.BaseHTTPRequestHandler):
    pods: dict[str, Any] = {}
    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization", "")))
        body = json.dumps(type(self).pods).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api(tmp_path: Path) -> Iterator[InCluster]:
    pki = mint(tmp_path / "pki")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pki.node.cert), str(pki.node.key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "namespace").write_text("csi-qsd\n")
    (account / "token").write_text("the-token\n")
    (account / "ca.crt").write_bytes(pki.node.ca.read_bytes())
    _ApiServer.seen = []
    try:
        yield InCluster.from_pod("127.0.0.1", str(server.server_address[1]), account)
    finally:
        server.shutdown()
        server.server_close()


async def test_the_list_is_asked_with_the_service_account_and_cached(api: InCluster) -> None:
    _ApiServer.pods = {"items": [_pod("a", "10.244.0.5"), _pod("b", "10.244.1.9")]}
    peers = PodCopyPeers(api, "app.kubernetes.io/component=node", 9811, max_age=60)
    assert await peers.current() == {"a": "10.244.0.5:9811", "b": "10.244.1.9:9811"}
    _ApiServer.pods = {"items": [_pod("a", "10.244.0.6")]}
    assert (await peers.current())["a"] == "10.244.0.5:9811"  # cached
    [(path, authorization)] = _ApiServer.seen
    assert path == "/api/v1/namespaces/csi-qsd/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Dnode"
    assert authorization == "Bearer the-token"


async def test_a_pod_made_again_is_found_at_its_new_address(api: InCluster) -> None:
    _ApiServer.pods = {"items": [_pod("a", "10.244.0.5")]}
    peers = PodCopyPeers(api, "x=y", 9811, max_age=0)
    assert await peers.current() == {"a": "10.244.0.5:9811"}
    _ApiServer.pods = {"items": [_pod("a", "10.244.0.9")]}
    assert await peers.current() == {"a": "10.244.0.9:9811"}


async def test_an_unreachable_api_server_is_unavailable_naming_it(tmp_path: Path, api: InCluster) -> None:
    gone = InCluster("https://127.0.0.1:1", api.namespace, api.token_file, api.ca_file)
    with pytest.raises(Unavailable, match="cannot list the node plugin pods .* in namespace csi-qsd"):
        await PodCopyPeers(gone, "x=y", 9811).current()


def test_outside_a_pod_the_missing_address_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        InCluster.from_pod("", "443", tmp_path)


def test_the_api_servers_certificate_is_not_held_to_pythons_strict_mode(api: InCluster) -> None:
    """Python 3.13 checks strictly by default (an authority key identifier, ...), client-go does not: a
    cluster whose API server certificate lacks one is still reached, its certificate still checked."""
    context = api.tls_context()
    assert not context.verify_flags & ssl.VERIFY_X509_STRICT
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
