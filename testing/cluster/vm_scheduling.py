"""What the scheduler weighs when it places a VM pod on a csi-qsd-vm claim: a KVM device, the node's free storage.

A KVM device plugin (KubeVirt's virt-handler, or any other) registers
`devices.kubevirt.io/kvm` with kubelet, which then reports it in the node's
status capacity and allocatable. No plugin runs here (and this machine's KVM
is not for guests), so `advertise_kvm` writes the resource into the node's
status itself, as the plugin's registration would have kubelet write it,
and takes it out again. kubelet keeps an extended resource it did not set:
its status updates patch only what changed since the node it read.

The pod is deploy/examples/qemu-vhost-user-blk.yaml's with busybox in place
of QEMU (no guest boots: placement is the question), which runs only once
its volume's vhost-user-blk socket is there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from csi_qsd.config import TOPOLOGY_KEY_NODE
from csi_qsd.params import parse_size
from testing.cluster import examples as ex
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import DRIVER_NAMESPACE, get_json, wait_until

KVM = "devices.kubevirt.io/kvm"
# What KubeVirt's device plugin offers per node: /dev/kvm is shared, the count only caps the pods.
KVM_DEVICES = "1k"
VM_CLASS = "csi-qsd-vm"
SELECTED_NODE = "volume.kubernetes.io/selected-node"
GIB = 1024**3


def _status_patch(op: str, value: str | None = None) -> str:
    key = KVM.replace("/", "~1")  # JSON pointer escape
    return json.dumps([{"op": op, "path": f"/status/{field}/{key}", **({"value": value} if value else {})}
                       for field in ("capacity", "allocatable")])


def node_kvm(cluster: Cluster, node: str) -> tuple[str | None, str | None]:
    """The node's `devices.kubevirt.io/kvm` in its status capacity and allocatable (None: not offered)."""
    status = get_json(cluster, "node", node)["status"]
    return status.get("capacity", {}).get(KVM), status.get("allocatable", {}).get(KVM)


@contextmanager
def advertise_kvm(cluster: Cluster, node: str) -> Iterator[None]:
    """`node` offers `devices.kubevirt.io/kvm` while inside; taken away after, whatever happened."""
    cluster.kubectl("patch", "node", node, "--subresource=status", "--type=json",
                    "-p", _status_patch("add", KVM_DEVICES))
    try:
        wait_until(lambda: node_kvm(cluster, node) == (KVM_DEVICES, KVM_DEVICES), 30, f"{node} to offer {KVM}")
        yield
    finally:
        cluster.kubectl("patch", "node", node, "--subresource=status", "--type=json",
                        "-p", _status_patch("remove"), check=False)
        wait_until(lambda: node_kvm(cluster, node) == (None, None), 30, f"{node} to offer no {KVM} again")


def vm_claim(name: str, size: str) -> dict[str, Any]:
    """The example's `csi-qsd-vm` claim (WaitForFirstConsumer), named `name`, of `size`."""
    claim = ex.pick(ex.example("qemu-vhost-user-blk.yaml"), "PersistentVolumeClaim")
    claim["metadata"]["name"] = name
    claim["spec"]["resources"]["requests"]["storage"] = size
    return claim


def vm_pod(name: str, claim: str, *, kvm: bool) -> dict[str, Any]:
    """The example's VM pod on `claim`, asking for a KVM device if `kvm`; busybox waits on the socket instead of QEMU.

    Small CPU and memory requests: the example's (a core, 1.5 GiB) would be the reason a node is refused
    on a two-core machine, and placement must turn on the device and the storage alone.
    """
    pod = ex.pick(ex.example("qemu-vhost-user-blk.yaml"), "Pod")
    pod["metadata"]["name"] = name
    [volume] = pod["spec"]["volumes"]
    volume["persistentVolumeClaim"]["claimName"] = claim
    [container] = pod["spec"]["containers"]
    [mount] = container["volumeMounts"]
    socket = f"{mount['mountPath']}/vhost-user-blk.sock"
    container.update({
        "image": "docker.io/library/busybox:1.36", "imagePullPolicy": "Never", "stdin": False, "tty": False,
        "command": ["/bin/sh", "-c"], "args": [f"test -S {socket} && exec sleep 3600000"],
    })
    limits = {KVM: container["resources"]["limits"][KVM]} if kvm else {}
    assert not kvm or limits[KVM] == "1", container["resources"]
    container["resources"] = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi", **limits}}
    return pod


def vm_capacity(cluster: Cluster, node: str) -> dict[str, Any]:
    """The CSIStorageCapacity `node`'s provisioner publishes for the `csi-qsd-vm` class (waited for)."""
    seen: list[dict[str, Any]] = []

    def published() -> dict[str, Any] | None:
        seen[:] = get_json(cluster, "-n", DRIVER_NAMESPACE, "csistoragecapacities")["items"]
        # The segment holds every key the node reports (its export kinds too); the node's name is one.
        found = [c for c in seen if c["storageClassName"] == VM_CLASS and c.get("capacity")
                 and ((c.get("nodeTopology") or {}).get("matchLabels") or {}).get(TOPOLOGY_KEY_NODE) == node]
        return found[0] if len(found) == 1 else None
    try:
        return wait_until(published, 120, f"{node}'s CSIStorageCapacity for {VM_CLASS}")  # type: ignore[no-any-return]
    except TimeoutError as error:
        summary = [(c["storageClassName"], c.get("nodeTopology"), c.get("capacity")) for c in seen]
        raise TimeoutError(f"{error}; published: {summary}") from None


def volume_limit(capacity: dict[str, Any]) -> int:
    """The largest claim a CSIStorageCapacity admits, in bytes: what the scheduler compares a claim with."""
    return parse_size(capacity.get("maximumVolumeSize") or capacity["capacity"])


def pv_nodes(pv: dict[str, Any]) -> list[str]:
    """The nodes a PersistentVolume's nodeAffinity allows, by csi-qsd's topology key."""
    return [value for term in pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
            for expression in term["matchExpressions"] if expression["key"] == TOPOLOGY_KEY_NODE
            for value in expression["values"]]


def claim_pvs(cluster: Cluster, namespace: str, claim: str) -> list[dict[str, Any]]:
    """Every PersistentVolume bound or being bound to `namespace`/`claim`."""
    return [pv for pv in get_json(cluster, "pv")["items"]
            if (pv["spec"].get("claimRef") or {}).get("namespace") == namespace
            and pv["spec"]["claimRef"].get("name") == claim]


def scheduling_failures(cluster: Cluster, namespace: str, pod: str) -> list[str]:
    """The messages of the scheduler's FailedScheduling events for `pod`."""
    items = get_json(cluster, "-n", namespace, "events", "--field-selector",
                     f"involvedObject.kind=Pod,involvedObject.name={pod},reason=FailedScheduling")["items"]
    return [str(e.get("message", "")) for e in items]


def node_volumes(cluster: Cluster, plugin_pod: str) -> set[str]:
    """The IDs of the volumes a node plugin pod holds, as `csi-qsd volume list` asks it over CSI."""
    out = cluster.kubectl("exec", "-n", DRIVER_NAMESPACE, plugin_pod, "-c", "csi-qsd", "--", "env",
                          "CSI_QSD_ENDPOINT=unix:///csi/csi.sock", "csi-qsd", "volume", "list", "-o", "json").stdout
    return {json.loads(line)["volume_id"] for line in out.splitlines() if line.strip()}
