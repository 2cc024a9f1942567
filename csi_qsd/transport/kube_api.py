"""The Kubernetes API as a pod reaches it: the address Kubernetes gives every pod, and its service account.

Used by the node plugin to find its peers for copies
(`csi_qsd.transport.copy_peer_pods`), to delete or tell the pods whose
volume was rebuilt (`csi_qsd.csi.heal_pods`) and to claim hand-made
snapshot contents (`csi_qsd.csi.snapshot_contents`). Plain HTTPS with the
service account's token: no client library.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csi_qsd.config import bracketed

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class InCluster:
    """How a pod reaches its API server: the address Kubernetes gives every pod, and its service account."""

    server: str  # https://HOST:PORT
    namespace: str
    token_file: Path
    ca_file: Path

    def tls_context(self) -> ssl.SSLContext:
        """The API server's certificate checked against the service account's CA, as Kubernetes' own clients
        check it: Python's strict mode (the default from 3.13) also wants extensions, such as an authority key
        identifier, that many clusters' API server certificates do not carry."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
        return context

    @classmethod
    def from_pod(cls, host: str, port: str, account: Path = SERVICE_ACCOUNT) -> InCluster:
        """From KUBERNETES_SERVICE_HOST and _PORT (which the caller read) and the mounted service account."""
        if not host or not port:
            raise ValueError("--peers-from-pods needs the API server's address (KUBERNETES_SERVICE_HOST and "
                             "KUBERNETES_SERVICE_PORT, which Kubernetes sets in every pod)")
        return cls(f"https://{bracketed(f'{host}:{port}')}", (account / "namespace").read_text().strip(),
                   account / "token", account / "ca.crt")

    def call(self, method: str, path: str, patch: dict[str, Any] | None = None,
             body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One API request with the service account's token; `patch` is sent as a JSON merge patch, `body` as
        JSON (an object to create, DeleteOptions). Raises OSError (also for an HTTP error answer) or ValueError
        (an answer that is not JSON)."""
        headers = {"Authorization": f"Bearer {self.token_file.read_text().strip()}", "Accept": "application/json"}
        data = None
        if patch is not None:
            headers["Content-Type"] = "application/merge-patch+json"
            data = json.dumps(patch).encode()
        elif body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        request = urllib.request.Request(f"{self.server}{path}", data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, context=self.tls_context(), timeout=10) as answer:
            return json.loads(answer.read())  # type: ignore[no-any-return]
