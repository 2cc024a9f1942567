"""Which pods a rebuild's healer deletes, tells or leaves alone; and the condition kept per cut-off target."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from csi_qsd.csi.heal_plan import Action, PodTarget, decide, pod_target
from csi_qsd.node.cut_off import REBUILT, CutOff, CutOffTargets

PV = "pvc-1111"
KUBELET = Path("/var/lib/kubelet")


def _mount_target(uid: str, pv: str = PV) -> Path:
    return KUBELET / "pods" / uid / "volumes" / "kubernetes.io~csi" / pv / "mount"


def _block_target(uid: str, pv: str = PV) -> Path:
    return KUBELET / "plugins" / "kubernetes.io" / "csi" / "volumeDevices" / "publish" / pv / uid


def _pod(uid: str, owner: str | None = "ReplicaSet", propagation: str | None = None, claim: str = "data",
         deleting: bool = False, extra_mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"pod-{uid}", "namespace": "ns", "uid": uid}
    if owner is not None:
        meta["ownerReferences"] = [{"kind": owner, "name": "owner-1", "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2026-11-28T00:00:00Z"
    mount: dict[str, Any] = {"name": "vol", "mountPath": "/data"}
    if propagation is not None:
        mount["mountPropagation"] = propagation
    return {"metadata": meta, "spec": {
        "containers": [{"name": "app", "volumeMounts": [mount, *(extra_mounts or [])]}],
        "volumes": [{"name": "vol", "persistentVolumeClaim": {"claimName": claim}},
                    {"name": "other", "persistentVolumeClaim": {"claimName": "other"}}]}}


CLAIMS = {("ns", "data"): PV, ("ns", "other"): "pvc-2222"}


def test_kubelet_target_paths_name_the_pod_and_the_volume() -> None:
    assert pod_target(_mount_target("uid-a")) == PodTarget("uid-a", PV)
    assert pod_target(_block_target("uid-b")) == PodTarget("uid-b", PV)
    assert pod_target(Path("/tmp/some/target")) is None
    assert pod_target(Path("/mount")) is None


@pytest.mark.parametrize("owner", ["ReplicaSet", "StatefulSet", "DaemonSet", "Job"])
def test_a_pod_a_controller_makes_again_is_deleted(owner: str) -> None:
    [decision] = decide([_pod("a", owner)], [_mount_target("a")], False, CLAIMS, delete=True)
    assert (decision.action, decision.name, decision.uid) == (Action.DELETE, "pod-a", "a")
    assert owner in decision.why


@pytest.mark.parametrize("owner", [None, "Node", "SomeOperatorKind"])
def test_a_bare_pod_or_one_no_known_controller_makes_again_is_only_told(owner: str | None) -> None:
    [decision] = decide([_pod("a", owner)], [_mount_target("a")], False, CLAIMS, delete=True)
    assert decision.action is Action.TELL


def test_with_deletion_turned_off_an_owned_pod_is_told_why_it_stays() -> None:
    [decision] = decide([_pod("a")], [_mount_target("a")], False, CLAIMS, delete=False)
    assert decision.action is Action.TELL and "--delete-pods-on-rebuild=false" in decision.why


@pytest.mark.parametrize("propagation", ["HostToContainer", "Bidirectional"])
def test_a_pod_that_receives_host_mounts_is_left_running(propagation: str) -> None:
    [decision] = decide([_pod("a", propagation=propagation)], [_mount_target("a")], False, CLAIMS, delete=True)
    assert decision.action is Action.KEEP


def test_one_private_mount_of_the_volume_is_enough_to_delete() -> None:
    private_too = [{"name": "vol", "mountPath": "/again"}]
    pod = _pod("a", propagation="HostToContainer", extra_mounts=private_too)
    [decision] = decide([pod], [_mount_target("a")], False, CLAIMS, delete=True)
    assert decision.action is Action.DELETE


def test_propagation_on_another_volume_does_not_count() -> None:
    pod = _pod("a", extra_mounts=[{"name": "other", "mountPath": "/o", "mountPropagation": "HostToContainer"}])
    [decision] = decide([pod], [_mount_target("a")], False, CLAIMS, delete=True)
    assert decision.action is Action.DELETE


def test_an_unknown_claim_counts_as_the_volume() -> None:
    pod = _pod("a", extra_mounts=[{"name": "other", "mountPath": "/o", "mountPropagation": "HostToContainer"}])
    pod["spec"]["containers"][0]["volumeMounts"][0]["mountPropagation"] = "HostToContainer"
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "other", "mountPath": "/p"})
    [decision] = decide([pod], [_mount_target("a")], False, {}, delete=True)
    assert decision.action is Action.DELETE  # "other" might be the volume, and one of its mounts is private


def test_a_block_volume_pod_is_deleted_whatever_its_propagation() -> None:
    [decision] = decide([_pod("a", propagation="HostToContainer")], [_block_target("a")], True, CLAIMS, delete=True)
    assert decision.action is Action.DELETE


def test_pods_not_cut_off_or_already_deleting_are_not_touched() -> None:
    pods = [_pod("a"), _pod("b", deleting=True), _pod("c")]
    decisions = decide(pods, [_mount_target("a"), _mount_target("b"), Path("/elsewhere")], False, CLAIMS,
                       delete=True)
    assert [d.name for d in decisions] == ["pod-a"]


def test_a_generic_ephemeral_volume_is_found_by_its_claim_name() -> None:
    pod = _pod("a", propagation="HostToContainer")
    pod["spec"]["volumes"][0] = {"name": "vol", "ephemeral": {"volumeClaimTemplate": {}}}
    [decision] = decide([pod], [_mount_target("a")], False, {("ns", "pod-a-vol"): PV, **CLAIMS}, delete=True)
    assert decision.action is Action.KEEP


def test_a_cut_off_target_reports_the_rebuild_until_it_is_unpublished() -> None:
    heard: list[CutOff] = []
    targets = CutOffTargets()
    targets.listen(heard.append)
    def failing(cut: CutOff) -> None:
        raise RuntimeError("a failing listener neither stops the others nor the rebuild")

    targets.listen(failing)
    cut = CutOff("vol-1", False, (_mount_target("a"), _mount_target("b")),
                 datetime.datetime(2026, 11, 28, 3, 4, 5, tzinfo=datetime.UTC))
    targets.add(cut)
    assert heard == [cut]
    assert targets.at(_mount_target("a")) is cut and targets.at(_mount_target("c")) is None
    message = cut.message()
    assert REBUILT in message and "vol-1" in message and "2026-11-28T03:04:05Z" in message and "EIO" in message
    targets.released(_mount_target("a"))
    assert targets.at(_mount_target("a")) is None and targets.at(_mount_target("b")) is cut
