"""An encrypted StorageClass with its real Secret, as an operator writes them: the objects a cluster test applies.

The class names one Secret for every call that needs the key (provisioner,
node-stage, controller-modify); a Role lets the node plugin's service
account read that Secret alone. A VolumeAttributesClass names the next key
version, for a rotation.
"""

from __future__ import annotations

from typing import Any

from testing.cluster.cluster import Cluster
from testing.cluster.deploy import DRIVER_NAMESPACE

PROVISIONER = "csi.storage.k8s.io/"


def encrypted_class_objects(namespace: str, secret: str, key: str, class_name: str,
                            parameters: dict[str, str]) -> list[dict[str, Any]]:
    """The Secret (in `namespace`), its Role and RoleBinding, the class `class_name` (`parameters` plus
    `encrypted`), and the VolumeAttributesClass `key-2-<namespace>` for a rotation to key version 2."""
    params = {**parameters, "encrypted": "true"}
    for call in ("provisioner", "node-stage", "controller-modify"):
        params[f"{PROVISIONER}{call}-secret-name"] = secret
        params[f"{PROVISIONER}{call}-secret-namespace"] = namespace
    meta = {"name": secret, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": {"key": key, "keyVersion": "1"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "subjects": [{"kind": "ServiceAccount", "name": "csi-qsd-node", "namespace": DRIVER_NAMESPACE}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": secret}},
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": class_name},
         "provisioner": "csi-qsd.io", "parameters": params, "reclaimPolicy": "Delete",
         "volumeBindingMode": "WaitForFirstConsumer"},
        {"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttributesClass", "metadata": {"name": f"key-2-{namespace}"},
         "driverName": "csi-qsd.io", "parameters": {"keyVersion": "2"}},
    ]


def delete_objects(cluster: Cluster, objects: list[dict[str, Any]]) -> None:
    """Delete what `encrypted_class_objects` made, last first (its claims must be gone: the provisioner reads
    the Secret again to delete a volume)."""
    for doc in reversed(objects):
        namespace = doc["metadata"].get("namespace")
        where = ["-n", namespace] if namespace else []
        cluster.kubectl("delete", *where, doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found",
                        check=False)
