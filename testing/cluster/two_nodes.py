"""A second node for the cluster, and what copies between nodes need from an operator.

The node plugins find each other in the Kubernetes API (`--peers-from-pods`,
as deploy/node.yaml ships it). What an operator adds for restores and clones
onto another node (deploy/snapshot-metadata/node-identity/README.md) is a
certificate of its own for each plugin, whose common name (and a DNS name)
is its node name. In a cluster with SPIRE, SPIRE's agent on each node writes that certificate into
the plugin's in-memory volume; this cluster has no SPIRE, so the harness
plays the node's attestation: it writes each node's own certificate into a
directory of that node alone (`IDENTITY_DIR`, on the node's own /var/lib),
and the DaemonSet's `metadata-tls` volume becomes that directory instead of
the shared Secret. Everything else is deploy/ as shipped.
"""

from __future__ import annotations

import json
from typing import Any

from testing.cluster.cluster import Cluster
from testing.cluster.deploy import DRIVER_NAMESPACE, get_json, wait_daemonset_ready, wait_until
from testing.cluster.kubelet_node import KubeletNode
from testing.cluster.pki import ClusterPKI

IDENTITY_DIR = "/var/lib/csi-qsd-node-identity"


def give_node_identities(cluster: Cluster, pki: ClusterPKI) -> None:
    """Each node's own certificate (CN and DNS name: the node name), key and CA, in its `IDENTITY_DIR`."""
    for node in cluster.nodes:
        pair = pki.issue(f"node-identity-{node.name}", node.name, hosts=(node.name,), server=True, client=True)
        node.namespace.run(["sh", "-c", f"mkdir -p {IDENTITY_DIR} && cp {pair.cert} {IDENTITY_DIR}/tls.crt && "
                                        f"cp {pair.key} {IDENTITY_DIR}/tls.key && cp {pki.ca} {IDENTITY_DIR}/ca.crt && "
                                        f"chmod 0600 {IDENTITY_DIR}/tls.key"])


def use_node_identities(cluster: Cluster) -> dict[str, Any]:
    """The DaemonSet's `metadata-tls` volume made the node's identity directory; the shipped object is returned."""
    shipped = get_json(cluster, "-n", DRIVER_NAMESPACE, "daemonset", "csi-qsd-node")
    changed = json.loads(json.dumps(shipped))
    for volume in changed["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "metadata-tls":
            volume.pop("secret", None)
            volume["hostPath"] = {"path": IDENTITY_DIR, "type": "Directory"}
    cluster.kubectl("replace", "-f", "-", input=json.dumps(_for_replace(changed)))
    return shipped  # type: ignore[no-any-return]


def restore_daemonset(cluster: Cluster, shipped: dict[str, Any]) -> None:
    cluster.kubectl("replace", "-f", "-", input=json.dumps(_for_replace(shipped)))


def _for_replace(obj: dict[str, Any]) -> dict[str, Any]:
    obj = json.loads(json.dumps(obj))
    obj.pop("status", None)
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        obj["metadata"].pop(key, None)
    return obj


def driver_pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The running node plugin pods by node name."""
    pods = get_json(cluster, "-n", DRIVER_NAMESPACE, "pods", "-l", "app.kubernetes.io/component=node")["items"]
    return {p["spec"]["nodeName"]: p for p in pods
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}


def recreate_driver_pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Delete every node plugin pod (the DaemonSet is OnDelete) and wait for the new ones, one per node."""
    cluster.kubectl("delete", "-n", DRIVER_NAMESPACE, "pods", "-l", "app.kubernetes.io/component=node",
                    "--wait=true", "--timeout=120s", timeout=150)
    wait_daemonset_ready(cluster)
    return wait_until(lambda: (pods := driver_pods(cluster)) and len(pods) == len(cluster.nodes) and pods,  # type: ignore[no-any-return]
                      120, "a running node plugin pod on every node")


def wait_registered(cluster: Cluster, node: KubeletNode) -> None:
    wait_until(lambda: any(d["name"] == "csi-qsd.io" for d in
                           (get_json(cluster, "csinode", node.name)["spec"].get("drivers") or [])),
               120, f"kubelet to register csi-qsd.io on {node.name} (CSINode)")
