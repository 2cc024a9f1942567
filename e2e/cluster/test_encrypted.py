"""An encrypted claim with a real Secret: a writing pod through a key rotation, a plugin restart and a QSD kill.

The StorageClass names one Secret for every call that needs the key
(provisioner, node-stage, controller-modify); the node plugin's service
account may read only that Secret (a Role with its name). A Deployment's
writer appends records with fsync and stops at the first failed write.
The Secret then gets a new key, its version and the old key as
`previousKey`, and the claim moves to a VolumeAttributesClass naming that
version: the resizer calls ControllerModifyVolume with the Secret and the
driver rotates the key on the live image. The writer must see no error.
Then the plugin container is killed (the node keeps the key in its tmpfs):
the writer goes on. Then QSD's container is killed: the driver reopens the
encrypted chain with the node's key and makes the Deployment's pod again,
which must read every acknowledged record. (The plugin's restart first
matters: its loop device then names its file "/" in sysfs, from a mount
namespace that is gone, and the rebuild must still know it for the volume's.)
"""

from __future__ import annotations

import base64
import re
import secrets
import time
from typing import Any

from e2e.cluster.conftest import cluster_marks, report
from testing.cluster import examples as ex
from testing.cluster import volume_secrets, writer
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import DRIVER_NAMESPACE, driver_pod, get_json, wait_until

pytestmark = cluster_marks()

def _objects(ns: str, secret: str, key: str) -> list[dict[str, Any]]:
    """The Secret (in the test's namespace), the Role that lets the node's sidecars read it, the class."""
    return volume_secrets.encrypted_class_objects(ns, secret, key, f"enc-{ns}", {"csi.storage.k8s.io/fstype": "ext4"})


def _claim(ns: str) -> dict[str, Any]:
    pvc = ex.pick(ex.example("filesystem-pod.yaml"), "PersistentVolumeClaim")
    pvc["metadata"]["name"] = "sealed"
    pvc["spec"]["storageClassName"] = f"enc-{ns}"
    return pvc


def _acks(text: str) -> int:
    return max((int(n) for n in re.findall(r"^ACK (\d+)$", text, re.M)), default=0)


def _plugin_log(cluster: Cluster) -> str:
    pod = driver_pod(cluster)["metadata"]["name"]
    return cluster.kubectl("logs", "-n", DRIVER_NAMESPACE, pod, "-c", "csi-qsd").stdout


def test_an_encrypted_claim_rotates_its_key_under_a_writer_and_survives_plugin_and_qsd_restarts(
        cluster: Cluster, test_namespace: str) -> None:
    ns, secret = test_namespace, f"key-{test_namespace}"
    old, new = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    objects = _objects(ns, secret, old)
    started = time.monotonic()
    try:
        ex.apply(cluster, ns, objects)
        ex.apply(cluster, ns, [_claim(ns),
                               writer.deployment("writer", writer.pod_spec("sealed", writer.HEALING_WRITER))])
        name = writer.running_pod_of(cluster, ns, "writer")["metadata"]["name"]
        pv = get_json(cluster, "pv", get_json(cluster, "-n", ns, "pvc", "sealed")["spec"]["volumeName"])
        handle = pv["spec"]["csi"]["volumeHandle"]
        assert pv["metadata"]["annotations"].get("volume.kubernetes.io/controller-modify-secret-name") == secret

        def logged() -> str:
            return cluster.kubectl("logs", "-n", ns, name).stdout

        wait_until(lambda: _acks(logged()) >= 20, 60, "the writer's first 20 acknowledged writes")

        # The rotation: the Secret first (new key, its version, the old key), then the claim's class.
        data = {"key": new, "keyVersion": "2", "previousKey": old}
        cluster.kubectl("patch", "secret", "-n", ns, secret, "--type=merge", "-p",
                        '{"data":{' + ",".join(f'"{k}":"{base64.b64encode(v.encode()).decode()}"'
                                               for k, v in data.items()) + "}}")
        at_rotation = _acks(logged())
        rotate_started = time.monotonic()
        cluster.kubectl("patch", "-n", ns, "pvc", "sealed", "--type=merge",
                        "-p", f'{{"spec":{{"volumeAttributesClassName":"key-2-{ns}"}}}}')
        wait_until(lambda: get_json(cluster, "-n", ns, "pvc", "sealed")["status"]
                   .get("currentVolumeAttributesClassName") == f"key-2-{ns}", 180,
                   f"the claim's current VolumeAttributesClass to become key-2-{ns}; events: "
                   f"{ex.events(cluster, ns, 'sealed')}", interval=1)
        rotated_in = time.monotonic() - rotate_started
        assert re.search(rf"event=key_rotated volume_id={handle} key_version=2 .*live=True", _plugin_log(cluster))
        wait_until(lambda: _acks(logged()) >= at_rotation + 20, 60, "20 more acknowledged writes after the rotation")
        assert "IOERR" not in logged(), logged()

        # The plugin container killed: the writer goes on, the node keeps the new key in its tmpfs.
        restarted = writer.kill_container(cluster, "csi-qsd")
        writer.wait_restarted(cluster, "csi-qsd", restarted)
        at_plugin = _acks(logged())
        wait_until(lambda: _acks(logged()) >= at_plugin + 20, 60, "20 more acknowledged writes after the plugin")
        text = logged()
        assert "IOERR" not in text
        assert writer.container_status(get_json(cluster, "-n", ns, "pod", name), "app")["restartCount"] == 0
        acked = _acks(text)

        # QSD's container killed: the driver opens the chain again with the node's key and remakes the pod.
        killed = time.monotonic()
        before = writer.kill_container(cluster, "qsd")
        writer.wait_restarted(cluster, "qsd", before)
        try:
            wait_until(lambda: writer.running_pod_of(cluster, ns, "writer")["metadata"]["name"] != name,
                       writer.HEAL_BOUND, "the driver to remake the writer's pod")
        except TimeoutError as exc:
            tail = "\n".join(_plugin_log(cluster).splitlines()[-60:])
            raise AssertionError(f"{exc}; events: {ex.events(cluster, ns, name)}; the plugin's log:\n{tail}") from exc
        name = writer.running_pod_of(cluster, ns, "writer")["metadata"]["name"]
        wait_until(lambda: _acks(logged()) >= acked + 20, writer.HEAL_BOUND, "20 acknowledged writes from the new writer")
        healed_in = time.monotonic() - killed

        # The records acknowledged before the faults are all in the file.
        numbers = [int(r) for r in ex.pod_exec(cluster, ns, name, "cat /data/log").split()]
        assert numbers[:acked] == list(range(1, acked + 1)), f"acknowledged writes lost ({acked} acknowledged)"
        plugin_log = _plugin_log(cluster)
        assert old not in plugin_log and new not in plugin_log
        report(f"encrypted claim: key rotated under a writing pod in {rotated_in:.1f} s (claim patched to current "
               f"class), no I/O error; through a plugin kill the writer went on; after a QSD kill the remade pod "
               f"wrote again {healed_in:.1f} s after the kill and read all {acked} acknowledged records; "
               f"{time.monotonic() - started:.0f} s in all")
    finally:
        # The claim goes before the Secret: the provisioner reads the Secret again to delete the volume.
        cluster.kubectl("delete", "-n", ns, "deployment", "writer", "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "-n", ns, "pvc", "sealed", "--wait=true", "--timeout=120s", check=False)
        wait_until(lambda: not [p for p in get_json(cluster, "pv")["items"]
                                if p["spec"].get("storageClassName") == f"enc-{ns}"], 120, "the claim's volume gone")
        volume_secrets.delete_objects(cluster, objects)
