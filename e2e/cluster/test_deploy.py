"""deploy/ applied with `kubectl apply -k` in a real cluster: the node plugin runs, kubelet registers it, capacity is
published, and the registrar and livenessprobe are the upstream programs."""

from __future__ import annotations

from e2e.cluster.conftest import cluster_marks
from testing.cluster import deploy
from testing.cluster.build import Built
from testing.cluster.cluster import Cluster

pytestmark = cluster_marks()


def test_daemonset_ready_and_registered_with_kubelet(cluster: Cluster) -> None:
    pod = deploy.driver_pod(cluster)
    statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
    assert set(statuses) == {"csi-qsd", "qsd", "node-driver-registrar", "csi-provisioner", "csi-snapshotter",
                             "csi-resizer", "liveness-probe"}
    assert all(c["ready"] for c in statuses.values()), statuses
    csinode = deploy.get_json(cluster, "csinode", cluster.node_name)
    [driver] = [d for d in csinode["spec"]["drivers"] if d["name"] == "csi-qsd.io"]
    assert driver["nodeID"] == cluster.node_name
    assert "topology.csi-qsd.io/node" in (driver.get("topologyKeys") or []), driver
    node = deploy.get_json(cluster, "node", cluster.node_name)
    assert any(k.startswith("topology.csi-qsd.io") for k in node["metadata"]["labels"]), node["metadata"]["labels"]


def test_storage_capacity_published_per_class(cluster: Cluster) -> None:
    def capacities() -> list[dict[str, object]]:
        items: list[dict[str, object]] = deploy.get_json(cluster, "-n", deploy.DRIVER_NAMESPACE,
                                                         "csistoragecapacities")["items"]
        return [c for c in items if c.get("capacity")]
    found = deploy.wait_until(capacities, 120, "CSIStorageCapacity objects from the provisioner")
    classes = {c["storageClassName"] for c in found}
    assert {"csi-qsd-fs", "csi-qsd-block", "csi-qsd-vm"} <= classes, classes


def test_registrar_and_livenessprobe_are_the_upstream_release_builds(cluster: Cluster, built: Built) -> None:
    assert {r.sidecar.container for r in built.releases} == {"node-driver-registrar", "liveness-probe"}
    pod = deploy.driver_pod(cluster)
    images = {c["name"]: c["image"] for c in pod["spec"]["containers"]}
    for release in built.releases:
        assert images[release.sidecar.container] == release.image
        assert deploy.executable_digest(cluster, pod, release.sidecar.container) == release.sha256, release.describe()
    [registrar] = [r for r in built.releases if r.sidecar.container == "node-driver-registrar"]
    log = cluster.kubectl("logs", "-n", deploy.DRIVER_NAMESPACE, pod["metadata"]["name"], "-c", "node-driver-registrar").stdout
    assert f'"Version" version="{registrar.tag}"' in log, log[:2000]
