"""Mutual TLS between the snapshot-metadata router and the node plugins, from PEM files.

Both sides present a certificate and accept only peers whose certificate the
configured CA signed: a node plugin's metadata listener answers no caller
without a client certificate of that CA, and the router trusts no node
without one. The files come from a Kubernetes Secret, which kubelet replaces
in place when it changes (cert-manager renewing it), so they are reread:
the listener on every TLS handshake, the router's and the peer nodes'
channels when a file's modification time moves (`ReloadingCredentials`). This module knows nothing of CSI.

Who a caller is (`caller_name`) depends on its certificate. A SPIFFE
certificate (an X.509-SVID: a `spiffe://` URI SAN) is known by its SPIFFE ID
alone, whose path csi-qsd's ClusterSPIFFEIDs set: `…/csi-qsd/node/<node>`
is node <node>, `…/csi-qsd/snapshot-metadata-router` is the router; any
other ID is no one here, and a common name that disagrees with the ID is
refused (a name template another workload controls may set the CN, never
this path). Any other certificate is known by its common name (CN): a node
plugin's names its node there (and in a DNS name, which callers of its
listener check); the router's names the router. The CA must be private to
csi-qsd: whoever can have it sign a certificate can be any node.
"""

from __future__ import annotations

import logging
import re

import grpc

from csi_qsd.sys.pem import PemFiles

log = logging.getLogger(__name__)

__all__ = ["RECONNECT_OPTIONS", "ROUTER_NAME", "PemFiles", "ReloadingCredentials", "caller_name",
           "channel_credentials", "identity", "server_credentials"]

# The router's name: its certificate's common name, or what its SPIFFE ID stands for.
ROUTER_NAME = "csi-qsd-snapshot-metadata-router"
# The SPIFFE IDs deploy/snapshot-metadata/node-identity/clusterspiffeids.yaml gives: the trust domain and the
# prefix (`/ns/<namespace>`) are SPIRE's; the last segments are ours, and a node name is one segment.
_SPIFFE_NODE = re.compile(r"^spiffe://[^/]+(/[^/]+)*/csi-qsd/node/(?P<node>[A-Za-z0-9][-A-Za-z0-9_.]*)\Z")
_SPIFFE_ROUTER = re.compile(r"^spiffe://[^/]+(/[^/]+)*/csi-qsd/snapshot-metadata-router\Z")

# gRPC backs off up to 120 s between reconnects by default; a node plugin back from a restart
# should be reachable again within seconds.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000))


def _server_config(pem: tuple[bytes, bytes, bytes]) -> grpc.ServerCertificateConfiguration:
    cert, key, ca = pem
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class _Reloader:
    """Gives gRPC a new certificate configuration when the files hold other bytes than last time."""

    def __init__(self, files: PemFiles, pem: tuple[bytes, bytes, bytes]) -> None:
        self._files = files
        self._pem = pem

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            pem = self._files.read()
        except OSError as exc:  # mid-swap, or the Secret went away: keep serving with what we have
            log.warning("event=tls_reload_failed cert=%s error=%r", self._files.cert, str(exc))
            return None
        if pem == self._pem:
            return None
        self._pem = pem
        log.info("event=tls_reloaded cert=%s", self._files.cert)
        return _server_config(pem)


def server_credentials(files: PemFiles) -> grpc.ServerCredentials:
    """Credentials of a listener that requires a client certificate signed by `files.ca`.

    Raises OSError when a file cannot be read at start.
    """
    pem = files.read()
    return grpc.dynamic_ssl_server_credentials(
        _server_config(pem), _Reloader(files, pem), require_client_authentication=True)


def channel_credentials(files: PemFiles) -> grpc.ChannelCredentials:
    """Credentials of a client that presents `files.cert` and trusts only servers `files.ca` signed.

    Raises OSError when a file cannot be read.
    """
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def identity(common_names: list[str], uris: list[str]) -> str:
    """Who a certificate with these common names and URI SANs is: a node's name, ROUTER_NAME, another common
    name, or '' (no one: refused everywhere).

    With a `spiffe://` URI SAN, the SPIFFE ID decides (exactly one URI SAN, one of ours, and any common name
    equal to what it names); without one, the one common name does.
    """
    cn = common_names[0] if len(common_names) == 1 else ""
    if not any(uri.startswith("spiffe://") for uri in uris):
        return cn
    if len(uris) != 1:
        return ""
    node = _SPIFFE_NODE.match(uris[0])
    name = node.group("node") if node else ROUTER_NAME if _SPIFFE_ROUTER.match(uris[0]) else ""
    if common_names and cn != name:
        return ""  # a common name that says otherwise: one of the two was not meant for us
    return name


def caller_name(context: grpc.aio.ServicerContext) -> str:
    """Who the caller is by the client certificate it presented (`identity`); '' if no one."""
    auth = context.auth_context()
    return identity([v.decode(errors="replace") for v in auth.get("x509_common_name", ())],
                    [v.decode(errors="replace") for v in auth.get("peer_uri", ())])


class ReloadingCredentials:
    """A client's credentials from `files`, made again when the files change (kubelet swapping a renewed Secret).

    Raises OSError at construction when a file cannot be read.
    """

    def __init__(self, files: PemFiles) -> None:
        self._files = files
        self._stamp = files.stamp()
        self.credentials = channel_credentials(files)

    def refresh(self) -> bool:
        """True if the files changed and `credentials` are new: channels made before use the old certificate."""
        try:
            stamp = self._files.stamp()
            if stamp == self._stamp:
                return False
            credentials = channel_credentials(self._files)
        except OSError as exc:  # mid-swap of a Secret's files: keep the certificate we have
            log.warning("event=tls_reload_failed cert=%s error=%r", self._files.cert, str(exc))
            return False
        self._stamp, self.credentials = stamp, credentials
        log.info("event=tls_reloaded cert=%s", self._files.cert)
        return True
