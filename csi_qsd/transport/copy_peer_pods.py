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
import time
import urllib.parse
import urllib.request
from typing import Any

from csi_qsd.config import bracketed
from csi_qsd.errors import Unavailable
from csi_qsd.transport.kube_api import InCluster

MAX_AGE = 5.0


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


class PodCopyPeers:
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
