"""Deploying into the test cluster as a user would: the snapshot CRDs and controller, then `kubectl apply -k`.

Also the waits every test needs (a pod Running, a PVC Bound, a DaemonSet
Ready), each bounded, each naming what it waited for and the last state it
saw, so a failure reads like an operator's `kubectl describe`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from testing.cluster.build import Built
from testing.cluster.cluster import Cluster

HERE = Path(__file__).resolve().parent
OVERLAY = HERE / "overlay"
HOSTPATH = HERE / "hostpath"
HOSTPATH_NAMESPACE = "csi-hostpath"
HOSTPATH_DRIVER = "hostpath.csi.k8s.io"
SNAPSHOT_CONTROLLER_IMAGE = "registry.k8s.io/sig-storage/snapshot-controller:v8.7.0"
DRIVER_NAMESPACE = "csi-qsd"


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy (returned); on timeout, raise with its last answer."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as error:  # a check may fail while the object is being made
            last = error
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def get_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def install_snapshot_support(cluster: Cluster, built: Built) -> None:
    """The snapshot CRDs from the snapshotter's client module and its controller, as a cluster admin installs them."""
    for crd in sorted(built.snapshot_crds.glob("*.yaml")):
        if crd.name != "kustomization.yaml":
            cluster.kubectl("apply", "--server-side", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/volumesnapshots.snapshot.storage.k8s.io",
                    "crd/volumesnapshotcontents.snapshot.storage.k8s.io",
                    "crd/volumesnapshotclasses.snapshot.storage.k8s.io")
    manifests = built.snapshot_controller_manifests
    docs: list[dict[str, Any]] = []
    for name in ("rbac-snapshot-controller.yaml", "setup-snapshot-controller.yaml"):
        docs += [d for d in yaml.safe_load_all((manifests / name).read_text()) if d]
    for doc in docs:
        # Distributed snapshotting, as deploy/README.md's prerequisites ask: the controller labels each
        # snapshot's content with its volume's node, so that node's csi-snapshotter takes it.
        if doc["kind"] == "ClusterRole":
            doc["rules"].append({"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]})
        if doc["kind"] == "Deployment":
            spec = doc["spec"]
            spec["replicas"] = 1
            for container in spec["template"]["spec"]["containers"]:
                container["image"] = SNAPSHOT_CONTROLLER_IMAGE
                container["imagePullPolicy"] = "Never"
                container["args"] = [a for a in container.get("args", []) if not a.startswith("--v=")] + [
                    "--v=2", "--enable-distributed-snapshotting"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def deploy_driver(cluster: Cluster) -> None:
    """`kubectl apply -k` of the overlay (deploy/ with local images), then wait for the node plugin to serve."""
    cluster.kubectl("apply", "-k", str(OVERLAY))
    wait_daemonset_ready(cluster)
    wait_until(lambda: any(d["name"] == "csi-qsd.io" for d in
                           (get_json(cluster, "csinode", cluster.node_name)["spec"].get("drivers") or [])),
               120, f"kubelet to register csi-qsd.io on {cluster.node_name} (CSINode)")


def deploy_hostpath(cluster: Cluster) -> None:
    """csi-driver-host-path beside csi-qsd (testing/cluster/hostpath/), then wait until kubelet has registered it."""
    cluster.kubectl("apply", "-k", str(HOSTPATH))
    wait_daemonset_ready(cluster, namespace=HOSTPATH_NAMESPACE, name="csi-hostpath-node")
    wait_until(lambda: any(d["name"] == HOSTPATH_DRIVER for d in
                           (get_json(cluster, "csinode", cluster.node_name)["spec"].get("drivers") or [])),
               120, f"kubelet to register {HOSTPATH_DRIVER} on {cluster.node_name} (CSINode)")


def wait_daemonset_ready(cluster: Cluster, timeout: float = 240, namespace: str = DRIVER_NAMESPACE,
                         name: str = "csi-qsd-node") -> None:
    def ready() -> bool:
        status = get_json(cluster, "-n", namespace, "daemonset", name)["status"]
        return bool(status.get("desiredNumberScheduled")) and \
            status.get("numberReady") == status.get("desiredNumberScheduled") and \
            status.get("updatedNumberScheduled") == status.get("desiredNumberScheduled")
    wait_until(ready, timeout, f"the {name} DaemonSet to be Ready", interval=1)


def driver_pod(cluster: Cluster) -> dict[str, Any]:
    pods = get_json(cluster, "-n", DRIVER_NAMESPACE, "pods", "-l", "app.kubernetes.io/component=node")["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    assert len(running) == 1, f"expected one running csi-qsd node pod, found {[p['metadata']['name'] for p in pods]}"
    return running[0]  # type: ignore[no-any-return]


def executable_digest(cluster: Cluster, pod: dict[str, Any], container: str) -> str:
    """The sha256 of the program `container` of `pod` runs, read on the first node from its task's /proc/PID/exe."""
    [status] = [c for c in pod["status"]["containerStatuses"] if c["name"] == container]
    container_id = status["containerID"].split("://", 1)[1]
    tasks = [line.split() for line in cluster.first.ctr("tasks", "ls").splitlines()[1:]]
    [pid] = [task[1] for task in tasks if task and task[0] == container_id]
    return cluster.node.run(["sha256sum", f"/proc/{pid}/exe"]).stdout.split()[0]
