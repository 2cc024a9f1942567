"""Mutual TLS between the snapshot-metadata router and the node plugins, from PEM files.

Both sides present a certificate and accept only peers whose certificate the
configured CA signed: a node plugin's metadata listener answers no caller
without a client certificate of that CA, and the router trusts no node
without one. The files come from a Kubernetes Secret, which kubelet replaces
in place when it changes (cert-manager renewing it), so they are reread:
the listener on every TLS handshake, the router's and the peer nodes'
channels when a file's modification time moves (`ReloadingCredentials`). This module knows nothing of CSI.

Who a caller is: the common name (CN) of the certificate it presented
(`caller_name`). A node plugin's certificate names its node there (and in a
DNS name, which callers of its listener check); the router's names the
router. The CA must be private to csi-qsd: whoever can have it sign a
certificate can be any node.
"""

from __future__ import annotations

import logging

import grpc

from csi_qsd.sys.pem import PemFiles

log = logging.getLogger(__name__)

__all__ = ["RECONNECT_OPTIONS", "PemFiles", "ReloadingCredentials", "caller_name", "channel_credentials",
           "server_credentials"]

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


def caller_name(context: grpc.aio.ServicerContext) -> str:
    """The common name of the client certificate the caller presented ('' if none, or not exactly one)."""
    names = list(context.auth_context().get("x509_common_name", ()))
    return names[0].decode(errors="replace") if len(names) == 1 else ""


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
