"""The other node plugins found in the Kubernetes API: the running pods of this DaemonSet, by node and pod IP.

A peer list written by hand (`--peer`, the ConfigMap `csi-qsd-peers`) names
pod IPs, and a pod IP changes each time its pod is made again (a node's
restart, an upgrade by deleting the pod): from then on copies to and from
that node fail until someone edits the list and restarts every plugin. With
`--peers-from-pods SELECTOR`, the plugin asks the API server, with its
service account, for the pods of its own namespace that match SELECTOR, and
takes each running one's node name and pod IP, at most every `MAX_AGE`
seconds, whenever a copy needs its peers. Which nodes may lease this node's
snapshots is still decided by the certificate each caller shows (its common
name must be a node found here).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csi_qsd.config import bracketed
from csi_qsd.errors import Unavailable

MAX_AGE = 5.0
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


def peers_of(pod_list: dict[str, Any], port: int) -> dict[str, str]:
    """Node name -> "POD_IP:port" for each running, not deleted pod of a PodList that has both."""
    found: dict[str, str] = {}
    for pod in pod_list.get("items") or []:
        node = (pod.get("spec") or {}).get("nodeName") or ""
        status = pod.get("status") or {}
        ip = status.get("podIP") or ""
        if node and ip and status.get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"):
            found[node] = bracketed(f"{ip}:{port}")
    return found


class PodPeers:
    """The peers as the API server has them now (cached `MAX_AGE` seconds)."""

    def __init__(self, api: InCluster, selector: str, port: int, max_age: float = MAX_AGE) -> None:
        self._api = api
        self._selector = selector
        self._port = port
        self._max_age = max_age
        self._peers: dict[str, str] = {}
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()

    def described(self) -> str:
        return f"--peers-from-pods {self._selector}"

    async def current(self) -> dict[str, str]:
        """Node name -> address of every node plugin running now. Raises Unavailable naming the API's error."""
        async with self._lock:
            if time.monotonic() - self._read_at > self._max_age:
                self._peers = peers_of(await asyncio.to_thread(self._list_pods), self._port)
                self._read_at = time.monotonic()
            return dict(self._peers)

    def _list_pods(self) -> dict[str, Any]:
        query = urllib.parse.urlencode({"labelSelector": self._selector})
        try:
            return self._api.call("GET", f"/api/v1/namespaces/{urllib.parse.quote(self._api.namespace)}/pods?{query}")
        except (OSError, ValueError) as exc:
            raise Unavailable(f"cannot list the node plugin pods ({self._selector}) in namespace "
                              f"{self._api.namespace} to find the other nodes: {exc}") from None
