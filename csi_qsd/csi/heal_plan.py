"""Which pods to delete after a rebuild cut their containers off a volume: pure decisions, no API calls.

kubelet names a pod's target after the pod's UID and the PersistentVolume
(`pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`, and for a raw block
volume `volumeDevices/publish/<pv>/<uid>`), so the cut-off targets say which
pods hold the dead data path. Of those, a pod whose controller makes it
again (`RECREATING`) is deleted, so it comes back on the new mount; a bare
pod only hears why (an event), since deleting it would lose it; a pod whose
every mount of the volume takes host mounts (`mountPropagation`
HostToContainer or Bidirectional) received the new mount over the dead one
and is left alone. A raw block device is a device node in the container,
never a mount: such pods are always restarted (or told).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

# Controllers that make a deleted pod again.
RECREATING = frozenset({"ReplicaSet", "StatefulSet", "DaemonSet", "Job"})
# Mount propagation through which a container receives the mount the driver makes over the dead one.
RECEIVING = frozenset({"HostToContainer", "Bidirectional"})
EVENT_REASON = "VolumeDataPathRebuilt"


class Action(enum.Enum):
    DELETE = "delete"  # owned by a controller that makes it again
    TELL = "tell"  # an event only: a bare pod, or deletion is turned off
    KEEP = "keep"  # it sees the new mount: an event says why it is left running


class PodTarget(NamedTuple):
    """A pod UID and PersistentVolume name read from a kubelet target path."""

    pod_uid: str
    pv: str


@dataclasses.dataclass(frozen=True)
class Decision:
    namespace: str
    name: str
    uid: str
    action: Action
    why: str  # the part of the event's message that is about this pod


def pod_target(target: Path) -> PodTarget | None:
    """The pod and PersistentVolume a kubelet target path belongs to, or None for a path of another shape."""
    parts = target.parts
    if len(parts) >= 6 and parts[-1] == "mount" and parts[-3] == "kubernetes.io~csi" and parts[-4] == "volumes" \
            and parts[-6:-5] == ("pods",):
        return PodTarget(parts[-5], parts[-2])
    if len(parts) >= 4 and parts[-3] == "publish" and parts[-4] == "volumeDevices":
        return PodTarget(parts[-1], parts[-2])
    return None


def claims_of(pod: Mapping[str, Any]) -> dict[str, str]:
    """Volume name -> PersistentVolumeClaim name of each claim the pod uses (a generic ephemeral one included)."""
    found: dict[str, str] = {}
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim:
            found[volume["name"]] = claim
        elif "ephemeral" in volume:
            found[volume["name"]] = f"{pod['metadata']['name']}-{volume['name']}"
    return found


def controller_of(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the pod's controller, or None for a bare pod."""
    for owner in pod["metadata"].get("ownerReferences") or []:
        if owner.get("controller"):
            return str(owner.get("kind", "")), str(owner.get("name", ""))
    return None


def receives_new_mount(pod: Mapping[str, Any], volume_names: set[str]) -> bool:
    """True if every container mount of these volumes takes host mounts (and there is at least one)."""
    spec = pod.get("spec") or {}
    mounts = [m for c in spec.get("containers") or [] for m in c.get("volumeMounts") or []
              if m.get("name") in volume_names]
    return bool(mounts) and all(m.get("mountPropagation") in RECEIVING for m in mounts)


def decide(pods: Sequence[Mapping[str, Any]], targets: Sequence[Path], block: bool,
           pv_of_claim: Mapping[tuple[str, str], str], delete: bool) -> list[Decision]:
    """What to do with each pod (on this node) whose target a rebuild cut off.

    `pv_of_claim` maps (namespace, claim) to its bound PersistentVolume; a
    claim missing there counts as the cut-off volume (the cautious side: the
    pod is then kept only if every claim it mounts receives host mounts).
    Pods being deleted already are skipped.
    """
    cut = {t.pod_uid: t.pv for t in map(pod_target, targets) if t is not None}
    decisions = []
    for pod in pods:
        meta = pod["metadata"]
        pv = cut.get(str(meta.get("uid", "")))
        if pv is None or meta.get("deletionTimestamp"):
            continue
        namespace, name = str(meta.get("namespace", "")), str(meta["name"])
        names = {volume for volume, claim in claims_of(pod).items()
                 if pv_of_claim.get((namespace, claim), pv) == pv}
        owner = controller_of(pod)
        if not block and receives_new_mount(pod, names):
            action, why = Action.KEEP, ("its containers mount the volume with mountPropagation HostToContainer and "
                                        "received the new mount over the dead one: left running (files opened "
                                        "before the crash answer EIO until reopened)")
        elif owner is not None and owner[0] in RECREATING and delete:
            action, why = Action.DELETE, f"deleting the pod so that its {owner[0]} {owner[1]} makes it again on " \
                                         "the new mount"
        elif owner is not None and owner[0] in RECREATING:
            action, why = Action.TELL, "restart the pod to use the volume again (the driver's deletion of such " \
                                       "pods is turned off: --delete-pods-on-rebuild=false)"
        else:
            action, why = Action.TELL, "delete and create the pod again to use the volume (no controller makes " \
                                       "it again, so the driver leaves it)"
        decisions.append(Decision(namespace, name, str(meta["uid"]), action, why))
    return decisions
