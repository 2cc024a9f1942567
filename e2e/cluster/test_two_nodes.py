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
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import conftest, two_nodes
from e2e.cluster import examples as ex
from e2e.cluster.build import Built
from e2e.cluster.cluster import Cluster
from e2e.cluster.deploy import get_json, wait_until
from e2e.cluster.node import KubeletNode
from e2e.cluster.pki import ClusterPKI

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
