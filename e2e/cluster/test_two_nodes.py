"""Two nodes: a snapshot taken on node A, restored by a pod that the scheduler puts on node B.

Node B is a second node namespace (its own containerd, kubelet, cgroup root,
/var/lib/kubelet and /var/lib/csi-qsd) joined to the cluster for this
module; the DaemonSet puts a node plugin on it. The restore goes the way
docs/snapshots-and-cbt.md describes: node B's provisioner takes the claim
(distributed provisioning), node B's plugin does not hold the snapshot and
asks its peers (the node plugin pods, found in the Kubernetes API) for a
read lease, node A serves the snapshot over NBD with
mutual TLS, and the new volume on node B reads through to it while it
fills. Each plugin proves its node with a certificate of its own
(`two_nodes` says how this cluster gives it one).

The same two nodes show the scheduler placing VM pods (`testing.cluster.vm_scheduling`): with
node A offering `devices.kubevirt.io/kvm` and node B not, a VM pod asking
for it lands on A and its WaitForFirstConsumer claim is provisioned there;
with a claim larger than A's CSIStorageCapacity it stays Pending, the
scheduler naming the storage; asking for no device, it may land on either
node and its volume is made where it lands.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import conftest
from testing.cluster import examples as ex
from testing.cluster import two_nodes, vm_scheduling
from testing.cluster.build import Built
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import get_json, wait_until
from testing.cluster.kubelet_node import KubeletNode
from testing.cluster.pki import ClusterPKI

pytestmark = conftest.cluster_marks()


@pytest.fixture(scope="module")
def node_b(cluster: Cluster, built: Built) -> Iterator[KubeletNode]:
    # Node B runs no VM: the QEMU image stays on node A.
    images = [archive for archive in built.images if not archive.name.startswith("qemu-")]
    added = cluster.add_node(images)
    problems: list[str] = []
    shipped: dict[str, Any] | None = None
    try:
        two_nodes.wait_registered(cluster, added)
        two_nodes.give_node_identities(cluster, ClusterPKI(cluster.base / "node-identity-pki"))
        shipped = two_nodes.use_node_identities(cluster)
        two_nodes.recreate_driver_pods(cluster)
        yield added
    finally:
        try:
            wait_until(lambda: not [pv for pv in get_json(cluster, "pv")["items"] if added.name in json.dumps(
                pv["spec"].get("nodeAffinity", {}))], 180, f"every PersistentVolume on {added.name} to be deleted")
        except TimeoutError as error:
            problems.append(str(error))
        left = added.namespace.run(["findmnt", "-rn", "-o", "TARGET"], check=False).stdout.splitlines()
        problems += [f"mount {m} on {added.name}" for m in left if "kubernetes.io~csi" in m or "/csi-qsd/" in m]
        problems += cluster.remove_node(added)
        if shipped is not None:
            two_nodes.restore_daemonset(cluster, shipped)
            two_nodes.recreate_driver_pods(cluster)
    assert not problems, f"node B left things behind: {problems}"


def _pinned(doc: dict[str, Any], node: str) -> dict[str, Any]:
    """`doc` (a Pod) scheduled only onto `node`, as a user's nodeSelector would (and no affinity)."""
    doc["spec"].pop("affinity", None)
    doc["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return doc


def test_pod_on_node_b_reads_a_snapshot_taken_on_node_a(cluster: Cluster, node_b: KubeletNode,
                                                         test_namespace: str) -> None:
    docs = ex.example("filesystem-pod.yaml")
    ex.apply(cluster, test_namespace, [ex.pick(docs, "PersistentVolumeClaim"),
                                       _pinned(ex.pick(docs, "Pod"), cluster.node_name)])
    ex.wait_pod_running(cluster, test_namespace, "csi-qsd-fs-demo")
    token = uuid.uuid4().hex
    # A file big enough that the copy is still streaming while the pod on B first reads it.
    ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo",
                f"echo {token} > /data/token && dd if=/dev/urandom of=/data/blob bs=1M count=64 2>/dev/null && "
                "md5sum /data/blob > /data/blob.md5 && sync /data")
    written = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", "cat /data/blob.md5").split()[0]

    restore = ex.example("snapshot-restore.yaml")
    ex.apply(cluster, test_namespace, [ex.pick(restore, "VolumeSnapshot")])
    wait_until(lambda: (get_json(cluster, "-n", test_namespace, "volumesnapshot", "csi-qsd-fs-demo-snap")
                        .get("status") or {}).get("readyToUse"), 120, "the VolumeSnapshot to be readyToUse")
    ex.apply(cluster, test_namespace, [ex.pick(restore, "PersistentVolumeClaim"),
                                       _pinned(ex.pick(restore, "Pod"), node_b.name)])
    pod = ex.wait_pod_running(cluster, test_namespace, "csi-qsd-fs-demo-restore", timeout=240)
    assert pod["spec"]["nodeName"] == node_b.name
    pv = get_json(cluster, "pv", ex.wait_pvc_bound(cluster, test_namespace, "csi-qsd-fs-demo-restore")
                  ["spec"]["volumeName"])
    assert node_b.name in json.dumps(pv["spec"]["nodeAffinity"]), pv["spec"]["nodeAffinity"]
    out = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo-restore",
                      "cat /data/token && md5sum /data/blob", timeout=300).split()
    assert out[0] == token and out[1] == written, out


# -- Placement: a VM pod goes where both the KVM device and the storage are -----------------------------------


@pytest.fixture
def kvm_node(cluster: Cluster, node_b: KubeletNode) -> Iterator[str]:
    """Node A offers `devices.kubevirt.io/kvm` for the test (and not after), node B does not."""
    assert vm_scheduling.node_kvm(cluster, node_b.name) == (None, None)
    with vm_scheduling.advertise_kvm(cluster, cluster.node_name):
        yield cluster.node_name


def _provisioned_on(cluster: Cluster, namespace: str, claim: str, node: str) -> None:
    """The claim's volume was made on `node`: the scheduler chose it, the PV's topology names it, its plugin holds it."""
    pvc = ex.wait_pvc_bound(cluster, namespace, claim)
    assert pvc["metadata"]["annotations"].get(vm_scheduling.SELECTED_NODE) == node, pvc["metadata"]["annotations"]
    pv = get_json(cluster, "pv", pvc["spec"]["volumeName"])
    assert vm_scheduling.pv_nodes(pv) == [node], pv["spec"]["nodeAffinity"]
    held = {name: vm_scheduling.node_volumes(cluster, pod["metadata"]["name"])
            for name, pod in two_nodes.driver_pods(cluster).items()}
    handle = pv["spec"]["csi"]["volumeHandle"]
    assert [name for name, volumes in held.items() if handle in volumes] == [node], (handle, held)


def test_vm_pod_asking_for_kvm_is_placed_and_provisioned_on_the_node_offering_it(
        cluster: Cluster, node_b: KubeletNode, kvm_node: str, test_namespace: str) -> None:
    # Node B could take the claim: only the device keeps the pod off it.
    assert vm_scheduling.volume_limit(vm_scheduling.vm_capacity(cluster, node_b.name)) >= vm_scheduling.GIB
    ex.apply(cluster, test_namespace, [vm_scheduling.vm_claim("vm-kvm", "1Gi"),
                                       vm_scheduling.vm_pod("vm-kvm", "vm-kvm", kvm=True)])
    pod = ex.wait_pod_running(cluster, test_namespace, "vm-kvm")
    assert pod["spec"]["nodeName"] == kvm_node
    _provisioned_on(cluster, test_namespace, "vm-kvm", kvm_node)


def test_vm_claim_larger_than_the_kvm_nodes_free_storage_stays_pending(
        cluster: Cluster, node_b: KubeletNode, kvm_node: str, test_namespace: str) -> None:
    free = vm_scheduling.volume_limit(vm_scheduling.vm_capacity(cluster, kvm_node))
    size = (2 * free // vm_scheduling.GIB + 1) * vm_scheduling.GIB
    ex.apply(cluster, test_namespace, [vm_scheduling.vm_claim("vm-big", f"{size // vm_scheduling.GIB}Gi"),
                                       vm_scheduling.vm_pod("vm-big", "vm-big", kvm=True)])
    # Node B lacks the device, node A the storage (the scheduler sorts its reasons).
    expected = f"0/2 nodes are available: 1 Insufficient {vm_scheduling.KVM}, 1 node(s) did not have enough free storage."
    try:
        wait_until(lambda: [m for m in vm_scheduling.scheduling_failures(cluster, test_namespace, "vm-big")
                            if m.startswith(expected)], 60, "the scheduler's FailedScheduling event naming storage")
    except TimeoutError as error:
        raise AssertionError(f"{error}; FailedScheduling: "
                             f"{vm_scheduling.scheduling_failures(cluster, test_namespace, 'vm-big')}") from None
    pod = get_json(cluster, "-n", test_namespace, "pod", "vm-big")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod["status"]
    [scheduled] = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable"), scheduled
    pvc = get_json(cluster, "-n", test_namespace, "pvc", "vm-big")
    assert pvc["status"]["phase"] == "Pending", pvc["status"]
    assert vm_scheduling.SELECTED_NODE not in pvc["metadata"].get("annotations", {}), pvc["metadata"]
    assert vm_scheduling.claim_pvs(cluster, test_namespace, "vm-big") == []


def test_vm_pod_without_kvm_lands_on_either_node_and_its_volume_follows(
        cluster: Cluster, node_b: KubeletNode, test_namespace: str) -> None:
    nodes = {cluster.node_name, node_b.name}
    for node in nodes:
        assert vm_scheduling.node_kvm(cluster, node) == (None, None)
        assert vm_scheduling.volume_limit(vm_scheduling.vm_capacity(cluster, node)) >= vm_scheduling.GIB
    ex.apply(cluster, test_namespace, [vm_scheduling.vm_claim("vm-any", "1Gi"),
                                       vm_scheduling.vm_pod("vm-any", "vm-any", kvm=False)])
    node = ex.wait_pod_running(cluster, test_namespace, "vm-any")["spec"]["nodeName"]
    assert node in nodes
    _provisioned_on(cluster, test_namespace, "vm-any", node)
    conftest.report(f"placement: the VM pod asking for no {vm_scheduling.KVM} was scheduled on {node}")
