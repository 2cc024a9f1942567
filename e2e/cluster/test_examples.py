"""Every container example in deploy/examples/, applied in the real cluster and checked with real pods.

The scheduler, the external-provisioner, kubelet and the resizer and
snapshotter sidecars make the calls; each test checks what a user sees: the
bytes a pod wrote, read back by another pod, the size a pod sees after a
PVC grows, the throughput a VolumeAttributesClass allows, and the event
that says why a claim too big for the node's pool stays Pending.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from csi_qsd.sys import caps
from e2e.cluster.conftest import cluster_marks
from testing.cluster import examples as ex
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import get_json, wait_until
from testing.cluster.outcomes import outcome

pytestmark = cluster_marks()


def _filesystem_demo(cluster: Cluster, namespace: str) -> str:
    """The filesystem example running, with a token of this run written and synced; the token."""
    ex.apply(cluster, namespace, ex.example("filesystem-pod.yaml"))
    ex.wait_pod_running(cluster, namespace, "csi-qsd-fs-demo")
    token = uuid.uuid4().hex
    ex.pod_exec(cluster, namespace, "csi-qsd-fs-demo", f"echo {token} > /data/token && sync /data/token")
    return token


def test_filesystem_pod_data_outlives_the_pod(cluster: Cluster, test_namespace: str) -> None:
    token = _filesystem_demo(cluster, test_namespace)
    out = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", "id -u; stat -c %g /data; df -k /data | tail -1")
    uid, group, df = out.splitlines()
    assert uid == "1000" and group == "1000", out  # fsGroup applied by the node plugin
    assert 900_000 < int(df.split()[1]) < 1_100_000, df  # a 1Gi filesystem
    ex.delete_pod(cluster, test_namespace, "csi-qsd-fs-demo")
    ex.apply(cluster, test_namespace, [ex.pick(ex.example("filesystem-pod.yaml"), "Pod")])
    ex.wait_pod_running(cluster, test_namespace, "csi-qsd-fs-demo")
    lines = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", "cat /data/token; wc -l < /data/hello.txt")
    assert lines.split() == [token, "2"], lines  # both pods appended their date line


def test_block_pod_reads_back_what_it_wrote(cluster: Cluster, test_namespace: str) -> None:
    ex.apply(cluster, test_namespace, ex.example("block-pod.yaml"))
    ex.wait_pod_running(cluster, test_namespace, "csi-qsd-block-demo")
    size = ex.pod_exec(cluster, test_namespace, "csi-qsd-block-demo", "blockdev --getsize64 /dev/xvda").strip()
    assert size == str(1 << 30)
    script = ("head -c 1048576 /dev/urandom > /tmp/p && dd if=/tmp/p of=/dev/xvda bs=65536 seek=100 oflag=direct "
              "conv=fsync 2>/dev/null && dd if=/dev/xvda bs=65536 skip=100 count=16 iflag=direct 2>/dev/null "
              "| cmp - /tmp/p && echo same")
    assert ex.pod_exec(cluster, test_namespace, "csi-qsd-block-demo", script).strip() == "same"


def test_snapshot_restore_and_clone_carry_the_bytes(cluster: Cluster, test_namespace: str) -> None:
    token = _filesystem_demo(cluster, test_namespace)
    docs = ex.example("snapshot-restore.yaml")
    ex.apply(cluster, test_namespace, [ex.pick(docs, "VolumeSnapshot")])

    def ready() -> bool:
        snap = get_json(cluster, "-n", test_namespace, "volumesnapshot", "csi-qsd-fs-demo-snap")
        return bool((snap.get("status") or {}).get("readyToUse"))
    wait_until(ready, 120, "the VolumeSnapshot to be readyToUse", interval=1)
    # Written after the snapshot: the restore must not see it, the clone (made later) must.
    ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", "echo after > /data/after && sync /data/after")
    ex.apply(cluster, test_namespace, [ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")])
    ex.apply(cluster, test_namespace, ex.example("clone.yaml"))
    for pod in ("csi-qsd-fs-demo-restore", "csi-qsd-fs-demo-clone"):
        ex.wait_pod_running(cluster, test_namespace, pod)
    restored = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo-restore", "cat /data/token; ls /data")
    assert restored.split()[0] == token and "after" not in restored.split()[1:], restored
    cloned = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo-clone", "cat /data/token /data/after")
    assert cloned.split() == [token, "after"], cloned


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_online_expansion_reaches_the_running_pod(cluster: Cluster, test_namespace: str, fs_type: str) -> None:
    if fs_type == "ext4" and not caps.has(caps.CAP_SYS_RESOURCE):
        pytest.skip("ext4 grows in use only with CAP_SYS_RESOURCE, which this host withholds even from privileged "
                    "containers (the driver answers FAILED_PRECONDITION saying so); xfs covers online growth here")
    klass = ex.pick(ex.example("../storageclasses.yaml"), "StorageClass", "csi-qsd-fs")
    klass["metadata"]["name"] = f"csi-qsd-fs-{fs_type}"
    klass["parameters"]["csi.storage.k8s.io/fstype"] = fs_type
    docs = ex.example("filesystem-pod.yaml")
    pvc, pod = ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")
    pvc["spec"]["storageClassName"] = klass["metadata"]["name"]
    ex.apply(cluster, test_namespace, [klass, pvc, pod])  # the class goes with the namespace (ex.delete_owned)
    ex.wait_pod_running(cluster, test_namespace, "csi-qsd-fs-demo")
    token = uuid.uuid4().hex
    ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", f"echo {token} > /data/token && sync /data/token")
    cluster.kubectl("patch", "-n", test_namespace, "pvc", "csi-qsd-fs-demo", "--type=merge",
                    "-p", '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}')

    def grown() -> int:
        df = ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", "df -k /data | tail -1")
        return int(df.split()[1]) if int(df.split()[1]) > 1_900_000 else 0
    try:
        wait_until(grown, 180, "the pod to see its filesystem at 2Gi", interval=2)
    except TimeoutError as error:
        raise TimeoutError(f"{error}; PVC events: {ex.events(cluster, test_namespace, 'csi-qsd-fs-demo')}") from None
    wait_until(lambda: get_json(cluster, "-n", test_namespace, "pvc", "csi-qsd-fs-demo")["status"]
               .get("capacity", {}).get("storage") == "2Gi", 60, "the PVC's capacity to read 2Gi")
    assert ex.pod_exec(cluster, test_namespace, "csi-qsd-fs-demo", "cat /data/token").strip() == token


def _direct_write_seconds(cluster: Cluster, namespace: str, pod: str, mib: int) -> float:
    start = time.monotonic()
    ex.pod_exec(cluster, namespace, pod, f"dd if=/dev/zero of=/data/probe bs=1M count={mib} oflag=direct 2>/dev/null",
                timeout=300)
    return time.monotonic() - start


def test_volume_attributes_class_applied_live(cluster: Cluster, test_namespace: str) -> None:
    docs = ex.example("volume-attributes-classes.yaml")
    pod = ex.pick(docs, "Pod")
    pod["spec"]["containers"][0]["args"] = ["exec sleep 3600000"]  # the test writes, not the example's loop
    ex.apply(cluster, test_namespace, [d for d in docs if d["kind"] == "VolumeAttributesClass"] +
             [ex.pick(docs, "PersistentVolumeClaim"), pod])
    ex.wait_pod_running(cluster, test_namespace, "csi-qsd-qos-demo")

    def switch(klass: str) -> None:
        cluster.kubectl("patch", "-n", test_namespace, "pvc", "csi-qsd-qos-demo", "--type=merge",
                        "-p", f'{{"spec":{{"volumeAttributesClassName":"{klass}"}}}}')
        wait_until(lambda: get_json(cluster, "-n", test_namespace, "pvc", "csi-qsd-qos-demo")["status"]
                   .get("currentVolumeAttributesClassName") == klass, 120,
                   f"the PVC's current VolumeAttributesClass to become {klass}; events: "
                   f"{ex.events(cluster, test_namespace, 'csi-qsd-qos-demo')}", interval=1)

    switch("csi-qsd-bronze")  # 20 MiB/s, 200 IOPS
    slow = _direct_write_seconds(cluster, test_namespace, "csi-qsd-qos-demo", 48)
    switch("csi-qsd-gold")  # no limit
    fast = _direct_write_seconds(cluster, test_namespace, "csi-qsd-qos-demo", 48)
    assert slow > 1.8, f"48 MiB took {slow:.2f}s under a 20 MiB/s limit"
    assert fast < slow / 2, f"48 MiB took {fast:.2f}s unlimited against {slow:.2f}s limited"


def test_claim_larger_than_the_pool_stays_pending_and_says_why(cluster: Cluster, test_namespace: str) -> None:
    docs = ex.example("filesystem-pod.yaml")
    pvc, pod = ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")
    pvc["spec"]["resources"]["requests"]["storage"] = "64Pi"
    ex.apply(cluster, test_namespace, [pvc, pod])

    def explained() -> str:
        text = ex.events(cluster, test_namespace, "csi-qsd-fs-demo")
        return text if "storage" in text.lower() else ""
    why = wait_until(explained, 90, "an event saying why the pod cannot be scheduled", interval=2)
    assert "FailedScheduling" in why and "enough free storage" in why, why
    assert get_json(cluster, "-n", test_namespace, "pvc", "csi-qsd-fs-demo")["status"]["phase"] == "Pending"
    assert get_json(cluster, "-n", test_namespace, "pod", "csi-qsd-fs-demo")["status"]["phase"] == "Pending"


# Every file in deploy/examples/ is run by a cluster test, or says here why it cannot run on this machine
# and which tests cover what it exercises.
RUN_HERE = {
    "filesystem-pod.yaml": "test_filesystem_pod_data_outlives_the_pod",
    "block-pod.yaml": "test_block_pod_reads_back_what_it_wrote",
    "snapshot-restore.yaml": "test_snapshot_restore_and_clone_carry_the_bytes",
    "clone.yaml": "test_snapshot_restore_and_clone_carry_the_bytes",
    "volume-attributes-classes.yaml": "test_volume_attributes_class_applied_live",
    "qemu-vhost-user-blk.yaml": "test_vm_pod.py::test_vm_pod_writes_and_a_second_vm_reads_back",
    "hotplug.yaml": "test_vm_pod.py::test_hotplug_example_adds_a_disk_to_a_running_vm",
}
NOT_HERE = {
    "kubevirt-vm.yaml": "needs KubeVirt (its Sidecar feature gate) and KVM; its disk is the vhost-user-blk socket the "
                        "QEMU example opens here, and tests/deploy/test_example_manifests.py runs its hook script on a sample domain",
    "device-pool.yaml": "needs an NVMe device (and vfio for its second class); device pools run against real "
                        "devices in tests/integration/test_device_pool*.py",
    "changed-blocks.yaml": "its reader is the snapshot-metadata router, which needs cert-manager; changed blocks are "
                           "tested in tests/integration/test_snapshot_metadata.py and test_snapshot_router.py",
}


REPO = Path(__file__).resolve().parents[2]


def _node_id(test: str) -> str:
    """`RUN_HERE`'s name of a test as pytest's node ID (a bare name is in this file)."""
    file, _, name = test.rpartition("::")
    return f"{Path(__file__).relative_to(REPO).parent / (file or Path(__file__).name)}::{name}"


@pytest.mark.cluster_tier_last
def test_every_example_runs_here_or_says_why_not() -> None:
    """And every test named here ran in this run and passed: it runs after the tier's other tests (conftest)."""
    files = {p.name for p in ex.EXAMPLES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(RUN_HERE) | set(NOT_HERE) == files, "an example is neither run in the cluster nor explained"
    assert not set(RUN_HERE) & set(NOT_HERE)
    results = {example: outcome(_node_id(test)) for example, test in RUN_HERE.items()}
    failed = {example: f"{RUN_HERE[example]}: {how}" for example, how in results.items() if how != "passed"}
    assert not failed, f"examples whose test did not pass in this run: {failed}"
