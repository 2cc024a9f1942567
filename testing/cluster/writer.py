"""A pod that writes numbered records with fsync while a node's plugin goes through a fault or an upgrade.

The writer appends numbered records to a file on a csi-qsd filesystem
volume, each with `dd conv=fsync`, and prints `ACK n` only after the fsync
returned: its log is the list of acknowledged writes. Any failed write ends
the container (restartPolicy Never), so "no I/O error" and "never
restarted" are the same observation; `check_writer` then finds every
acknowledged record in the file, in order.
"""

from __future__ import annotations

import re
from typing import Any

from testing.cluster import examples as ex
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import driver_pod, get_json, wait_until

WRITER = r"""
i=0
while :; do
  i=$((i+1))
  printf '%08d\n' $i > /tmp/record
  if ! dd if=/tmp/record of=/data/log bs=9 oflag=append conv=notrunc,fsync 2>/tmp/err; then
    echo "IOERR $i $(cat /tmp/err)"; exit 1
  fi
  echo "ACK $i"
  sleep 0.05
done
"""


def start_writer(cluster: Cluster, namespace: str) -> None:
    docs = ex.example("filesystem-pod.yaml")
    pvc, pod = ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")
    pod["metadata"]["name"] = "writer"
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["containers"][0]["args"] = [WRITER]
    ex.apply(cluster, namespace, [pvc, pod])
    ex.wait_pod_running(cluster, namespace, "writer")


def acks(cluster: Cluster, namespace: str) -> tuple[int, list[str]]:
    log = cluster.kubectl("logs", "-n", namespace, "writer").stdout
    numbers = [int(n) for n in re.findall(r"^ACK (\d+)$", log, re.M)]
    return (max(numbers) if numbers else 0), re.findall(r"^IOERR .*$", log, re.M)


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [status] = [c for c in pod["status"]["containerStatuses"] if c["name"] == name]
    return status  # type: ignore[no-any-return]


def wait_restarted(cluster: Cluster, name: str, before: int) -> None:
    def back() -> bool:
        status = container_status(driver_pod(cluster), name)
        return int(status["restartCount"]) > before and bool(status["ready"])
    wait_until(back, 180, f"the node plugin's {name} container to restart and be ready", interval=1)


def check_writer(cluster: Cluster, namespace: str) -> None:
    pod = get_json(cluster, "-n", namespace, "pod", "writer")
    acked, errors = acks(cluster, namespace)
    assert not errors, f"the writer saw I/O errors: {errors}"
    assert pod["status"]["phase"] == "Running" and container_status(pod, "app")["restartCount"] == 0, \
        ex.dumps(pod["status"])
    records = ex.pod_exec(cluster, namespace, "writer", "cat /data/log").split()
    numbers = [int(r) for r in records]
    assert numbers[:acked] == list(range(1, acked + 1)), \
        f"acknowledged writes lost: {acked} acknowledged, file holds {len(numbers)}, first gap at " \
        f"{next((i + 1 for i, n in enumerate(numbers) if n != i + 1), None)}"


def kill_container(cluster: Cluster, name: str) -> int:
    """SIGKILL one container of the node plugin's pod, as an OOM kill or a crash would; its restart count before."""
    status = container_status(driver_pod(cluster), name)
    container_id = status["containerID"].split("://", 1)[1]
    cluster.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)
    return int(status["restartCount"])


# The Deployment's writer: numbers its records on from what the file holds, never exits on an I/O error (the
# old pod goes on failing on the dead mount until the driver deletes it), and retries the record it failed.
HEALING_WRITER = r"""
i=$(( $(cat /data/log 2>/dev/null | wc -l) + 0 ))
while :; do
  i=$((i+1))
  printf '%08d\n' $i > /tmp/record
  if ! dd if=/tmp/record of=/data/log bs=9 oflag=append conv=notrunc,fsync 2>/tmp/err; then
    echo "IOERR $i $(cat /tmp/err)"; i=$((i-1)); sleep 0.5; continue
  fi
  echo "ACK $i"
  sleep 0.05
done
"""
HEAL_BOUND = 120.0  # seconds from QSD's container ready again to the Deployment's new writer acknowledging writes
def pod_spec(claim: str, script: str, propagation: str = "") -> dict[str, Any]:
    spec = ex.pick(ex.example("filesystem-pod.yaml"), "Pod")["spec"]
    spec["containers"][0]["args"] = [script]
    spec["volumes"][0]["persistentVolumeClaim"]["claimName"] = claim
    spec["terminationGracePeriodSeconds"] = 2  # sh as PID 1 ignores SIGTERM
    if propagation:
        spec["containers"][0]["volumeMounts"][0]["mountPropagation"] = propagation
    return spec  # type: ignore[no-any-return]


def deployment(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"heal": name}},
                     "template": {"metadata": {"labels": {"heal": name}}, "spec": spec}}}


def pods_of(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    """The pods of Deployment `name`, not being deleted."""
    pods = get_json(cluster, "-n", namespace, "pods", "-l", f"heal={name}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def running_pod_of(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    def one_running() -> dict[str, Any] | None:
        pods = [p for p in pods_of(cluster, namespace, name) if p["status"].get("phase") == "Running"]
        return pods[0] if len(pods) == 1 else None
    return wait_until(one_running, 180, f"a running pod of {name}", interval=1)  # type: ignore[no-any-return]
