"""A cluster with csi-qsd deployed: started, used, stopped, and what its teardown must find gone.

The benches use `deployed_cluster`; the cluster tier's fixtures (conftest.py)
and `scripts/cluster.sh` (up.py) use the teardown steps: delete what holds
volumes so the driver unpublishes, unstages and deletes them as it would in
a real cluster, then look for what it left (a mount, a loop device).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from testing import owner
from testing.cluster import deploy
from testing.cluster.build import Built
from testing.cluster.cluster import Binaries, Cluster

# Namespaces whose pods are the cluster's own: their workloads are never deleted to release volumes.
SYSTEM_NAMESPACES = frozenset({deploy.DRIVER_NAMESPACE, "kube-system", "kube-public", "kube-node-lease"})


def start_deployed(cluster: Cluster, built: Built) -> None:
    """Start `cluster` with the snapshot CRDs and controller and csi-qsd (`kubectl apply -k` of the overlay)."""
    cluster.start(list(built.images))
    deploy.install_snapshot_support(cluster, built)
    deploy.deploy_driver(cluster)


@contextmanager
def deployed_cluster(built: Built) -> Iterator[Cluster]:
    """A started cluster with csi-qsd deployed (`start_deployed`); removed after."""
    base = owner.make_base("csi-qsd-bench-cluster-", Path("/var/tmp"))
    cluster = Cluster(base, Binaries(built.kubernetes))
    try:
        start_deployed(cluster, built)
        yield cluster
    finally:
        problems = cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
        if problems:
            print("cluster teardown left:", problems)


def alive(cluster: Cluster) -> bool:
    """Whether the control plane's node still runs (a teardown's API calls make sense)."""
    return cluster.pki is not None and cluster.node.holder is not None and cluster.node.holder.poll() is None


def release_volumes(cluster: Cluster, namespaces: Iterable[str], *, delete_namespaces: bool,
                    timeout: float = 180) -> list[str]:
    """Delete `namespaces` (or the pods, claims and snapshots in them) and wait until every PV is gone.

    The driver then has unpublished, unstaged and deleted every volume, as it would in a real cluster.
    Returns what did not happen in time.
    """
    for name in namespaces:
        if delete_namespaces:
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        else:
            cluster.kubectl("delete", "-n", name, "pods,persistentvolumeclaims", "--all", "--grace-period=1",
                            "--wait=false", check=False)
            cluster.kubectl("delete", "-n", name, "volumesnapshots.snapshot.storage.k8s.io", "--all",
                            "--wait=false", check=False)
    try:
        deploy.wait_until(lambda: not deploy.get_json(cluster, "pv")["items"], timeout,
                          "every PersistentVolume to be deleted")
    except TimeoutError as error:
        return [str(error)]
    return []


def user_namespaces(cluster: Cluster) -> list[str]:
    """Every namespace but the cluster's own (`SYSTEM_NAMESPACES`)."""
    return [n["metadata"]["name"] for n in deploy.get_json(cluster, "namespaces")["items"]
            if n["metadata"]["name"] not in SYSTEM_NAMESPACES]


def volume_leftovers(cluster: Cluster) -> list[str]:
    """Mounts of volumes and loop devices over FUSE exports still on the nodes (none after `release_volumes`)."""
    node_mounts = cluster.node.run(["findmnt", "-rn", "-o", "TARGET,FSTYPE"], check=False).stdout.splitlines()
    left = [m for m in node_mounts if "/volumes/kubernetes.io~csi/" in m or "/volumeDevices/kubernetes.io~csi/" in m
            or "/plugins/kubernetes.io/csi/" in m or m.startswith("/var/lib/csi-qsd/") and "fuse" in m]
    problems = [f"mount {m}" for m in left]
    for node in cluster.nodes:
        # Detached anyway when the node stops: the host keeps no loop device once the node is gone.
        problems += [f"loop device {device} over one of {node.name}'s FUSE exports" for device in node.loop_devices()]
    return problems
