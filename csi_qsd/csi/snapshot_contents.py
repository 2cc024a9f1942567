"""Pre-provisioned VolumeSnapshotContents claimed by the node that holds their snapshot.

With distributed snapshotting, each node's csi-snapshotter watches only the
VolumeSnapshotContents labelled `snapshot.storage.kubernetes.io/managed-by:
<its node>`. The snapshot controller labels the contents it makes for a
VolumeSnapshot of a claim, but nothing labels one an operator writes by hand
(a `snapshotHandle` only, to import a snapshot or to bind a VolumeSnapshot to
one that exists): no sidecar takes it, and its VolumeSnapshot never becomes
ready. With `--claim-snapshot-contents`, the plugin lists the unlabelled
contents of its driver every `INTERVAL` seconds and labels each whose
snapshot its own catalog holds with its node name; the label then stays, so
a content is claimed once, by the one node that has its snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from csi_qsd.errors import Unavailable
from csi_qsd.transport.kube_api import InCluster

log = logging.getLogger(__name__)

MANAGED_BY = "snapshot.storage.kubernetes.io/managed-by"
CONTENTS = "/apis/snapshot.storage.k8s.io/v1/volumesnapshotcontents"
INTERVAL = 10.0


@dataclass(frozen=True)
class Unclaimed:
    """A content no node's sidecar takes yet: its name and the snapshot it names."""

    name: str
    snapshot_id: str


def unclaimed(content_list: dict[str, Any], driver: str) -> list[Unclaimed]:
    """The pre-provisioned contents of `driver` in a VolumeSnapshotContentList that carry no managed-by label."""
    found: list[Unclaimed] = []
    for content in content_list.get("items") or []:
        metadata = content.get("metadata") or {}
        spec = content.get("spec") or {}
        handle = (spec.get("source") or {}).get("snapshotHandle") or ""
        if (spec.get("driver") == driver and handle and MANAGED_BY not in (metadata.get("labels") or {})
                and not metadata.get("deletionTimestamp")):
            found.append(Unclaimed(metadata["name"], handle))
    return found


class ContentClaimer:
    """Labels the unclaimed contents whose snapshot this node holds, so that this node's csi-snapshotter takes them."""

    def __init__(self, api: InCluster, driver: str, node: str, holds: Callable[[str], Awaitable[bool]],
                 interval: float = INTERVAL) -> None:
        self._api = api
        self._driver = driver
        self._node = node
        self._holds = holds
        self._interval = interval

    async def run(self) -> None:
        """Claim, then again every interval, until cancelled; an API error is logged and tried again."""
        while True:
            try:
                await self.claim_once()
            except Unavailable as exc:
                log.warning("event=snapshot_contents_unclaimed error=%r", str(exc))
            await asyncio.sleep(self._interval)

    async def claim_once(self) -> list[str]:
        """Label every unclaimed content whose snapshot is this node's; the names labelled."""
        listed = await asyncio.to_thread(self._request, "GET", f"{CONTENTS}?" + urllib.parse.urlencode(
            {"labelSelector": f"!{MANAGED_BY}"}))
        claimed: list[str] = []
        for content in unclaimed(listed, self._driver):
            if await self._holds(content.snapshot_id):
                patch = {"metadata": {"labels": {MANAGED_BY: self._node}}}
                await asyncio.to_thread(self._request, "PATCH", f"{CONTENTS}/{urllib.parse.quote(content.name)}",
                                        patch)
                log.info("event=snapshot_content_claimed content=%s snapshot_id=%s node=%s", content.name,
                         content.snapshot_id, self._node)
                claimed.append(content.name)
        return claimed

    def _request(self, method: str, path: str, patch: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return self._api.call(method, path, patch)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"cannot {method} {path.split('?')[0]} to claim pre-provisioned snapshot contents "
                              f"for node {self._node}: {exc}") from None
