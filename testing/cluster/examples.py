"""deploy/examples/ applied into a test namespace as a user would, and the pods they make, watched and asked.

Each example file is applied as shipped; only the namespace is set (the
examples go into the current namespace). `pod_exec` runs a command in a
running pod; `wait_pod_running` and `wait_pvc_bound` wait with a bound and
report the pod's events when they give up, as `kubectl describe` would.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from testing.cluster.cluster import Cluster
from testing.cluster.deploy import get_json, wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def example(name: str) -> list[dict[str, Any]]:
    """The objects of deploy/examples/`name`."""
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def pick(docs: list[dict[str, Any]], kind: str, name: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (not name or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name} in the example, found {len(found)}"
    return copy.deepcopy(found[0])


CLUSTER_SCOPED = ("VolumeAttributesClass", "StorageClass", "ClusterRole", "ClusterRoleBinding")
# On what `apply` makes outside the namespace: the test namespace's teardown deletes it by this label.
OWNER_LABEL = "csi-qsd-test-namespace"


def apply(cluster: Cluster, namespace: str, docs: list[dict[str, Any]]) -> None:
    """Apply `docs` into `namespace`; cluster-scoped ones are labelled as the namespace's, for `delete_owned`."""
    for doc in docs:
        metadata = doc.setdefault("metadata", {})
        if doc["kind"] in CLUSTER_SCOPED:
            metadata.setdefault("labels", {})[OWNER_LABEL] = namespace
        else:
            metadata["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def delete_owned(cluster: Cluster, namespace: str) -> None:
    """Delete the cluster-scoped objects `apply` made for `namespace` (after it, whatever the test's outcome)."""
    cluster.kubectl("delete", ",".join(kind.lower() for kind in CLUSTER_SCOPED), "-l", f"{OWNER_LABEL}={namespace}",
                    "--ignore-not-found", "--wait=false", check=False)


def events(cluster: Cluster, namespace: str, name: str) -> str:
    items = get_json(cluster, "-n", namespace, "events", "--field-selector", f"involvedObject.name={name}")["items"]
    return "; ".join(f"{e.get('reason')}: {e.get('message')}" for e in items[-8:])


def wait_pod_running(cluster: Cluster, namespace: str, name: str, timeout: float = 180) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        pod = get_json(cluster, "-n", namespace, "pod", name)
        statuses = pod["status"].get("containerStatuses") or []
        if pod["status"].get("phase") == "Running" and statuses and all(s.get("ready") for s in statuses):
            return pod  # type: ignore[no-any-return]
        return None
    try:
        return wait_until(running, timeout, f"pod {namespace}/{name} to run", interval=1)  # type: ignore[no-any-return]
    except TimeoutError as error:
        raise TimeoutError(f"{error}; events: {events(cluster, namespace, name)}") from None


def wait_pvc_bound(cluster: Cluster, namespace: str, name: str, timeout: float = 120) -> dict[str, Any]:
    def bound() -> dict[str, Any] | None:
        pvc = get_json(cluster, "-n", namespace, "pvc", name)
        return pvc if pvc["status"].get("phase") == "Bound" else None
    try:
        return wait_until(bound, timeout, f"PVC {namespace}/{name} to be Bound", interval=1)  # type: ignore[no-any-return]
    except TimeoutError as error:
        raise TimeoutError(f"{error}; events: {events(cluster, namespace, name)}") from None


def pod_exec(cluster: Cluster, namespace: str, pod: str, script: str, timeout: float = 120) -> str:
    """Run `script` with sh in the pod's first container; its stdout (raises on a non-zero exit)."""
    return cluster.kubectl("exec", "-n", namespace, pod, "--", "sh", "-c", script, timeout=timeout).stdout


def delete_pod(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "-n", namespace, "pod", name, "--grace-period=1", "--wait=true", "--timeout=120s",
                    timeout=150)


def pvc_volume_handle(cluster: Cluster, namespace: str, claim: str) -> str:
    pvc = get_json(cluster, "-n", namespace, "pvc", claim)
    pv = get_json(cluster, "pv", pvc["spec"]["volumeName"])
    return str(pv["spec"]["csi"]["volumeHandle"])


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:2000]
