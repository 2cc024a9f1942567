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
import subprocess
import tempfile
import time
from typing import Any

import pytest

from e2e.cluster.conftest import cluster_marks, report
from testing.cluster import examples as ex
from testing.cluster import writer
from testing.cluster.build import UPGRADE_IMAGE
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import DRIVER_NAMESPACE, driver_pod, get_json, wait_daemonset_ready, wait_until

pytestmark = cluster_marks()

def _upgrade_plugin_in_place(cluster: Cluster) -> None:
    """deploy/README.md's upgrade: a new image in the DaemonSet's template, then the running pod's image set in place.

    The new image is another image (`build.UPGRADE_IMAGE`: one more label, its own ID), and the DaemonSet's
    template is set back whatever happens, so the tests after this one run the image they were built with.
    """
    pod = driver_pod(cluster)
    old = writer.container_status(pod, "csi-qsd")["image"]
    old_id = writer.container_status(pod, "csi-qsd")["imageID"]
    try:
        cluster.kubectl("-n", DRIVER_NAMESPACE, "set", "image", "daemonset/csi-qsd-node", f"csi-qsd={UPGRADE_IMAGE}")
        before = int(writer.container_status(pod, "csi-qsd")["restartCount"])
        cluster.kubectl("-n", DRIVER_NAMESPACE, "set", "image", f"pod/{pod['metadata']['name']}",
                        f"csi-qsd={UPGRADE_IMAGE}")
        writer.wait_restarted(cluster, "csi-qsd", before)
        upgraded = driver_pod(cluster)
        [spec] = [c for c in upgraded["spec"]["containers"] if c["name"] == "csi-qsd"]
        assert spec["image"] == UPGRADE_IMAGE
        assert writer.container_status(upgraded, "csi-qsd")["imageID"] != old_id, "the upgrade ran the same image"
    finally:
        cluster.kubectl("-n", DRIVER_NAMESPACE, "set", "image", "daemonset/csi-qsd-node", f"csi-qsd={old}")


@pytest.mark.parametrize("fault", ["plugin-container-killed", "plugin-upgraded-in-place"])
def test_pod_writes_through_a_plugin_fault(cluster: Cluster, test_namespace: str, fault: str) -> None:
    writer.start_writer(cluster, test_namespace)
    qsd_restarts = int(writer.container_status(driver_pod(cluster), "qsd")["restartCount"])
    wait_until(lambda: writer.acks(cluster, test_namespace)[0] >= 20, 60, "the writer's first 20 acknowledged writes")
    if fault == "plugin-container-killed":
        before = writer.kill_container(cluster, "csi-qsd")
        writer.wait_restarted(cluster, "csi-qsd", before)
    else:
        _upgrade_plugin_in_place(cluster)
    wait_daemonset_ready(cluster)
    at_recovery = writer.acks(cluster, test_namespace)[0]
    wait_until(lambda: writer.acks(cluster, test_namespace)[0] >= at_recovery + 20, 60,
               "20 more acknowledged writes after the plugin came back")
    writer.check_writer(cluster, test_namespace)
    # Volume calls after the fault: the restarted plugin provisions, stages and publishes a new claim.
    _new_claim_works(cluster, test_namespace, "after-fault")
    assert int(writer.container_status(driver_pod(cluster), "qsd")["restartCount"]) == qsd_restarts, "QSD restarted"


def _new_claim_works(cluster: Cluster, namespace: str, name: str) -> None:
    """A new claim and a pod on it: CreateVolume, NodeStage and NodePublish answered; a synced write reads back."""
    docs = ex.example("filesystem-pod.yaml")
    pvc, pod = ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")
    pvc["metadata"]["name"] = pod["metadata"]["name"] = name
    pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = name
    pod["spec"]["containers"][0]["args"] = ["exec sleep 3600000"]
    ex.apply(cluster, namespace, [pvc, pod])
    ex.wait_pod_running(cluster, namespace, name)
    assert ex.pod_exec(cluster, namespace, name,
                       "echo fresh | dd of=/data/fresh conv=fsync 2>/dev/null && cat /data/fresh").strip() == "fresh"


EVENT_REASON = "VolumeDataPathRebuilt"  # csi_qsd.csi.heal_plan


def _claim(name: str) -> dict[str, Any]:
    pvc = ex.pick(ex.example("filesystem-pod.yaml"), "PersistentVolumeClaim")
    pvc["metadata"]["name"] = name
    return pvc


class _Log:
    """A pod's log followed from the start until its container ends (`kubectl logs -f`), kept whole."""

    def __init__(self, cluster: Cluster, namespace: str, pod: str) -> None:
        self._file = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [cluster.bin["kubectl"], f"--kubeconfig={cluster.admin_kubeconfig}", "logs", "-f", "-n", namespace, pod],
            stdout=self._file, stderr=subprocess.STDOUT, text=True)

    def text(self) -> str:
        self._file.flush()
        self._file.seek(0)
        return self._file.read()

    def acks(self) -> int:
        return max((int(n) for n in re.findall(r"^ACK (\d+)$", self.text(), re.M)), default=0)

    def wait_ended(self, timeout: float) -> str:
        self._proc.wait(timeout)
        return self.text()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._file.close()


def _events(cluster: Cluster, namespace: str, pod: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "-n", namespace, "events", "--field-selector",
                     f"involvedObject.name={pod},reason={EVENT_REASON}")["items"]
    return items  # type: ignore[no-any-return]


def _volume_of(cluster: Cluster, namespace: str, claim: str) -> tuple[str, str, str]:
    """(PV name, PV UID, volume handle) bound to the claim."""
    pvc = get_json(cluster, "-n", namespace, "pvc", claim)
    pv = get_json(cluster, "pv", pvc["spec"]["volumeName"])
    return pv["metadata"]["name"], pv["metadata"]["uid"], pv["spec"]["csi"]["volumeHandle"]


def _block_deployment() -> tuple[dict[str, Any], dict[str, Any]]:
    """deploy/examples/block-pod.yaml's claim, and its pod as a Deployment's."""
    docs = ex.example("block-pod.yaml")
    pvc, spec = ex.pick(docs, "PersistentVolumeClaim"), ex.pick(docs, "Pod")["spec"]
    pvc["metadata"]["name"] = spec["volumes"][0]["persistentVolumeClaim"]["claimName"] = "heal-block"
    spec["containers"][0]["args"] = ["exec sleep 3600000"]
    spec["terminationGracePeriodSeconds"] = 2
    return pvc, writer.deployment("block", spec)


def test_qsd_killed_heals_a_deployment_and_tells_a_bare_pod(cluster: Cluster, test_namespace: str) -> None:
    """QSD's container SIGKILLed under four pods, each with its own volume (docs/crashes-and-recovery.md).

    Expected, one outcome each: the Deployment's writer (fsync per record) is deleted by the driver and made
    again by its ReplicaSet within writer.HEAL_BOUND s of QSD being back, the new pod reads every record the old one
    acknowledged and writes on, and the claim keeps its PersistentVolume; the bare pod is kept, with an event
    naming its volume and the crash; the Deployment whose pod mounts with mountPropagation HostToContainer is
    kept, with an event, and writes with fsync through its mount (it received the new mount); the Deployment
    with a raw block volume is made again within the bound and reads what was synced to the device.
    """
    ns = test_namespace
    block_claim, block = _block_deployment()
    ex.apply(cluster, ns, [_claim("heal-writer"), _claim("heal-bare"), _claim("heal-propagation"), block_claim])
    bare = ex.pick(ex.example("filesystem-pod.yaml"), "Pod")
    bare["metadata"] = {"name": "bare"}
    bare["spec"] = writer.pod_spec("heal-bare", "exec sleep 3600000")
    ex.apply(cluster, ns, [writer.deployment("writer", writer.pod_spec("heal-writer", writer.HEALING_WRITER)), bare,
                           writer.deployment("receiver", writer.pod_spec("heal-propagation", "exec sleep 3600000",
                                                             propagation="HostToContainer")), block])
    old_writer = writer.running_pod_of(cluster, ns, "writer")
    receiver = writer.running_pod_of(cluster, ns, "receiver")
    old_block = writer.running_pod_of(cluster, ns, "block")
    bare_pod = ex.wait_pod_running(cluster, ns, "bare")
    ex.pod_exec(cluster, ns, receiver["metadata"]["name"],
                "echo before | dd of=/data/before conv=fsync 2>/dev/null")
    ex.pod_exec(cluster, ns, old_block["metadata"]["name"],
                "echo synced-before | dd of=/dev/xvda bs=4096 conv=sync,fsync 2>/dev/null")
    volumes = {claim: _volume_of(cluster, ns, claim)
               for claim in ("heal-writer", "heal-bare", "heal-propagation", "heal-block")}
    pv_count = len(get_json(cluster, "pv")["items"])
    old_log = _Log(cluster, ns, old_writer["metadata"]["name"])
    try:
        wait_until(lambda: old_log.acks() >= 20, 60, "the writer's first 20 acknowledged writes")
        killed = time.monotonic()
        before = writer.kill_container(cluster, "qsd")
        writer.wait_restarted(cluster, "qsd", before)
        qsd_back = time.monotonic()
        # The old writer's container ends when the driver deletes its pod; its log then holds every ACK.
        old_text = old_log.wait_ended(writer.HEAL_BOUND)
    finally:
        old_log.close()
    acked = max(int(n) for n in re.findall(r"^ACK (\d+)$", old_text, re.M))
    assert re.search(r"^IOERR ", old_text, re.M), "the old writer never hit the dead mount"

    new_writer = writer.running_pod_of(cluster, ns, "writer")
    assert new_writer["metadata"]["uid"] != old_writer["metadata"]["uid"]
    new_name = new_writer["metadata"]["name"]

    def new_acks() -> int:
        log = cluster.kubectl("logs", "-n", ns, new_name).stdout
        return max((int(n) for n in re.findall(r"^ACK (\d+)$", log, re.M)), default=0)
    wait_until(lambda: new_acks() >= acked + 1, max(1.0, writer.HEAL_BOUND - (time.monotonic() - qsd_back)),
               "the new writer's first acknowledged write")
    writing_after = time.monotonic() - killed
    wait_until(lambda: new_acks() >= acked + 20, 60, "20 acknowledged writes from the new writer")
    numbers = [int(r) for r in ex.pod_exec(cluster, ns, new_name, "cat /data/log").split()]
    assert numbers[:acked] == list(range(1, acked + 1)), \
        f"acknowledged writes lost: {acked} acknowledged, file holds {len(numbers)}, first gap at " \
        f"{next((i + 1 for i, n in enumerate(numbers) if n != i + 1), None)}"
    assert "IOERR" not in cluster.kubectl("logs", "-n", ns, new_name).stdout
    [writer_event] = _events(cluster, ns, old_writer["metadata"]["name"])
    assert volumes["heal-writer"][2] in writer_event["message"] and "ReplicaSet" in writer_event["message"]

    # The bare pod: kept, told.
    bare_now = get_json(cluster, "-n", ns, "pod", "bare")
    assert bare_now["metadata"]["uid"] == bare_pod["metadata"]["uid"]
    assert not bare_now["metadata"].get("deletionTimestamp")
    [bare_event] = wait_until(lambda: _events(cluster, ns, "bare"), 30, f"a {EVENT_REASON} event on pod bare")
    assert volumes["heal-bare"][2] in bare_event["message"] and "qemu-storage-daemon" in bare_event["message"] \
        and "died" in bare_event["message"], bare_event["message"]

    # The HostToContainer pod: kept, told, and it writes through the mount it received.
    receiver_now = writer.running_pod_of(cluster, ns, "receiver")
    assert receiver_now["metadata"]["uid"] == receiver["metadata"]["uid"]
    [receiver_event] = _events(cluster, ns, receiver["metadata"]["name"])
    assert "HostToContainer" in receiver_event["message"], receiver_event["message"]
    assert ex.pod_exec(cluster, ns, receiver["metadata"]["name"],
                       "cat /data/before && echo after | dd of=/data/after conv=fsync 2>/dev/null && "
                       "cat /data/after").split() == ["before", "after"]

    # The block pod: made again, and its device holds what was synced before the crash.
    new_block = writer.running_pod_of(cluster, ns, "block")
    assert new_block["metadata"]["uid"] != old_block["metadata"]["uid"]
    block_after = time.monotonic() - killed
    assert block_after - (qsd_back - killed) <= writer.HEAL_BOUND, block_after
    assert ex.pod_exec(cluster, ns, new_block["metadata"]["name"],
                       "dd if=/dev/xvda bs=4096 count=1 2>/dev/null | head -c 13") == "synced-before"
    [block_event] = _events(cluster, ns, old_block["metadata"]["name"])
    assert volumes["heal-block"][2] in block_event["message"] and "raw block device" in block_event["message"]

    # No claim re-provisioned.
    assert {claim: _volume_of(cluster, ns, claim) for claim in volumes} == volumes
    assert len(get_json(cluster, "pv")["items"]) == pv_count
    healed = [line for line in cluster.kubectl("logs", "-n", DRIVER_NAMESPACE, driver_pod(cluster)["metadata"]["name"],
                                               "-c", "csi-qsd").stdout.splitlines() if "event=pod_healed" in line]
    assert len(healed) == 4, healed
    report(f"QSD killed: container ready again {qsd_back - killed:.1f} s after the kill; the writer's new pod "
           f"acknowledged its first write {writing_after:.1f} s after the kill (bound: {writer.HEAL_BOUND:g} s after QSD "
           f"is back), the block pod ran again by {block_after:.1f} s; {acked} acknowledged records, all read "
           f"back by the new pod ({len(numbers)} in the file)")
