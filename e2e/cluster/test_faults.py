"""Faults on a node while a pod writes with fsync: the plugin container killed, upgraded in place, QSD killed.

The writer appends numbered records to a file on a csi-qsd filesystem
volume, each with `dd conv=fsync`, and prints `ACK n` only after the fsync
returned: its log is the list of acknowledged writes. Any failed write ends
the container (restartPolicy Never), so "no I/O error" and "never
restarted" are the same observation. After each fault the test waits for
the node plugin to be back and for the writer to go on writing, then checks
that every acknowledged record is in the file, in order.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from e2e.cluster import examples as ex
from e2e.cluster.cluster import Cluster
from e2e.cluster.conftest import cluster_marks
from e2e.cluster.deploy import DRIVER_NAMESPACE, driver_pod, get_json, wait_daemonset_ready, wait_until

pytestmark = cluster_marks()

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


def _writer(cluster: Cluster, namespace: str) -> None:
    docs = ex.example("filesystem-pod.yaml")
    pvc, pod = ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")
    pod["metadata"]["name"] = "writer"
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["containers"][0]["args"] = [WRITER]
    ex.apply(cluster, namespace, [pvc, pod])
    ex.wait_pod_running(cluster, namespace, "writer")


def _acks(cluster: Cluster, namespace: str) -> tuple[int, list[str]]:
    log = cluster.kubectl("logs", "-n", namespace, "writer").stdout
    acks = [int(n) for n in re.findall(r"^ACK (\d+)$", log, re.M)]
    return (max(acks) if acks else 0), re.findall(r"^IOERR .*$", log, re.M)


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [status] = [c for c in pod["status"]["containerStatuses"] if c["name"] == name]
    return status  # type: ignore[no-any-return]


def _kill_container(cluster: Cluster, name: str) -> int:
    """SIGKILL one container of the node plugin's pod, as an OOM kill or a crash would; its restart count before."""
    status = _container(driver_pod(cluster), name)
    container_id = status["containerID"].split("://", 1)[1]
    cluster.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)
    return int(status["restartCount"])


def _wait_restarted(cluster: Cluster, name: str, before: int) -> None:
    def back() -> bool:
        status = _container(driver_pod(cluster), name)
        return int(status["restartCount"]) > before and bool(status["ready"])
    wait_until(back, 180, f"the node plugin's {name} container to restart and be ready", interval=1)


def _upgrade_plugin_in_place(cluster: Cluster) -> None:
    """deploy/README.md's upgrade: a new tag in the DaemonSet's template, then the running pod's image set in place."""
    pod = driver_pod(cluster)
    old = _container(pod, "csi-qsd")["image"]
    new = f"{old.rsplit(':', 1)[0]}:0.1.0-upgrade"
    cluster.ctr("images", "tag", "--force", old, new)
    cluster.kubectl("-n", DRIVER_NAMESPACE, "set", "image", "daemonset/csi-qsd-node", f"csi-qsd={new}")
    before = int(_container(pod, "csi-qsd")["restartCount"])
    cluster.kubectl("-n", DRIVER_NAMESPACE, "set", "image", f"pod/{pod['metadata']['name']}", f"csi-qsd={new}")
    _wait_restarted(cluster, "csi-qsd", before)
    # The status names the image by its first tag (both tags are one image): the spec says what runs.
    [spec] = [c for c in driver_pod(cluster)["spec"]["containers"] if c["name"] == "csi-qsd"]
    assert spec["image"] == new
    cluster.kubectl("-n", DRIVER_NAMESPACE, "set", "image", "daemonset/csi-qsd-node", f"csi-qsd={old}")


@pytest.mark.parametrize("fault", ["plugin-container-killed", "plugin-upgraded-in-place"])
def test_pod_writes_through_a_plugin_fault(cluster: Cluster, test_namespace: str, fault: str) -> None:
    _writer(cluster, test_namespace)
    qsd_restarts = int(_container(driver_pod(cluster), "qsd")["restartCount"])
    wait_until(lambda: _acks(cluster, test_namespace)[0] >= 20, 60, "the writer's first 20 acknowledged writes")
    if fault == "plugin-container-killed":
        before = _kill_container(cluster, "csi-qsd")
        _wait_restarted(cluster, "csi-qsd", before)
    else:
        _upgrade_plugin_in_place(cluster)
    wait_daemonset_ready(cluster)
    at_recovery = _acks(cluster, test_namespace)[0]
    wait_until(lambda: _acks(cluster, test_namespace)[0] >= at_recovery + 20, 60,
               "20 more acknowledged writes after the plugin came back")
    # A volume call after the fault: the restarted plugin serves new claims too.
    _check_writer(cluster, test_namespace)
    assert int(_container(driver_pod(cluster), "qsd")["restartCount"]) == qsd_restarts, "QSD restarted"


def _check_writer(cluster: Cluster, namespace: str) -> None:
    pod = get_json(cluster, "-n", namespace, "pod", "writer")
    acked, errors = _acks(cluster, namespace)
    assert not errors, f"the writer saw I/O errors: {errors}"
    assert pod["status"]["phase"] == "Running" and _container(pod, "app")["restartCount"] == 0, \
        ex.dumps(pod["status"])
    records = ex.pod_exec(cluster, namespace, "writer", "cat /data/log").split()
    numbers = [int(r) for r in records]
    assert numbers[:acked] == list(range(1, acked + 1)), \
        f"acknowledged writes lost: {acked} acknowledged, file holds {len(numbers)}, first gap at " \
        f"{next((i + 1 for i, n in enumerate(numbers) if n != i + 1), None)}"


def test_qsd_killed_under_a_writing_pod_loses_no_acknowledged_write(cluster: Cluster, test_namespace: str) -> None:
    """QSD's container killed: the driver starts a new QSD and remounts the volume (docs/crashes-and-recovery.md).

    A write in flight on the old FUSE connection fails (the writer stops, as documented: such pods must be
    restarted); every write acknowledged before is in the file, and a new pod reads it.
    """
    _writer(cluster, test_namespace)
    wait_until(lambda: _acks(cluster, test_namespace)[0] >= 20, 60, "the writer's first 20 acknowledged writes")
    before = _kill_container(cluster, "qsd")
    _wait_restarted(cluster, "qsd", before)
    wait_daemonset_ready(cluster)

    def writer_outcome() -> str:
        pod = get_json(cluster, "-n", test_namespace, "pod", "writer")
        return str(pod["status"].get("phase")) if pod["status"].get("phase") != "Running" else ""
    acked_before = _acks(cluster, test_namespace)[0]
    try:
        outcome = wait_until(writer_outcome, 20, "the writer to stop")
    except TimeoutError:
        outcome = "Running"
    acked, errors = _acks(cluster, test_namespace)
    if outcome == "Running":  # it wrote on: every write since went through the new QSD
        wait_until(lambda: _acks(cluster, test_namespace)[0] >= acked_before + 20, 60, "20 more writes")
        _check_writer(cluster, test_namespace)
        return
    assert outcome == "Failed" and len(errors) == 1, (outcome, errors)
    ex.delete_pod(cluster, test_namespace, "writer")
    reader = ex.pick(ex.example("filesystem-pod.yaml"), "Pod")
    reader["metadata"]["name"] = "reader"
    ex.apply(cluster, test_namespace, [reader])
    ex.wait_pod_running(cluster, test_namespace, "reader")
    numbers = [int(r) for r in ex.pod_exec(cluster, test_namespace, "reader", "cat /data/log").split()]
    assert numbers[:acked] == list(range(1, acked + 1)), f"{acked} acknowledged, file holds {len(numbers)}"
