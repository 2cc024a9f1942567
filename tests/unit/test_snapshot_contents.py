"""Which VolumeSnapshotContents a node claims: its driver's pre-provisioned ones that no sidecar takes yet."""

from __future__ import annotations

from typing import Any

from csi_qsd.csi.snapshot_contents import MANAGED_BY, Unclaimed, unclaimed

DRIVER = "csi-qsd.io"


def content(name: str, *, driver: str = DRIVER, handle: str = "", volume: str = "", labels: dict[str, str] | None = None,
            deleting: bool = False) -> dict[str, Any]:
    source = {"snapshotHandle": handle} if handle else {"volumeHandle": volume}
    metadata: dict[str, Any] = {"name": name, "labels": labels or {}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-26T12:00:00Z"
    return {"metadata": metadata, "spec": {"driver": driver, "source": source}}


def test_a_hand_made_content_of_this_driver_is_unclaimed() -> None:
    listed = {"items": [content("pre", handle="snap-1")]}
    assert unclaimed(listed, DRIVER) == [Unclaimed("pre", "snap-1")]


def test_contents_a_node_manages_other_drivers_and_dynamic_ones_are_left_alone() -> None:
    listed = {"items": [
        content("labelled", handle="snap-1", labels={MANAGED_BY: "node-a"}),
        content("other-driver", handle="snap-2", driver="hostpath.csi.k8s.io"),
        content("dynamic", volume="vol-1"),
        content("deleting", handle="snap-3", deleting=True),
        content("wanted", handle="snap-4", labels={"team": "a"}),
    ]}
    assert unclaimed(listed, DRIVER) == [Unclaimed("wanted", "snap-4")]


def test_an_empty_list_claims_nothing() -> None:
    assert unclaimed({"items": None}, DRIVER) == []
    assert unclaimed({}, DRIVER) == []
