"""A pod running QEMU on a csi-qsd-vm claim: deploy/examples/qemu-vhost-user-blk.yaml with the e2e guest.

The guest writes a pattern with O_DIRECT + fsync and reads it back; a second
VM pod reads it again, so the bytes went through the volume, not a cache. A
third VM writes for as long as the test kills the plugin container and then
QSD's container: the guest reconnects and reports no I/O error, and every
block it acknowledged is there when read back. The hotplug example runs too
(attachment pod, node agent, `chardev-add` + `device_add`).

Kept from the examples, as shipped: the claim's class, volume mode and
access mode; the socket path (read out of the example's QEMU arguments) and
its chardev with `reconnect=1`; `vhost-user-blk-pci` with one queue; guest
RAM from `memory-backend-memfd` with `share=on` (vhost-user needs it);
fsGroup 107, to which the plugin gives the socket; for hotplug, the
attachment pod, the agent (its ConfigMap, DaemonSet, ServiceAccount,
ClusterRole), the `pcie-root-port` and the QMP socket path.

Where the tests depart from them, and why:

- Image: the QEMU image built here (`build.QEMU_IMAGE`), QEMU as the
  command. The examples' Debian image installs QEMU with apt at start, which
  needs egress this machine does not have.
- `-accel tcg`, no `-cpu host`, and no `devices.kubevirt.io/kvm` limit: no
  KVM device plugin runs here, and this machine's KVM hangs a stock kernel.
- `-smp 1 -m 256M` (memfd 256M), requests 100m CPU and 384Mi, limit 512Mi,
  instead of 2 CPUs and 1G (1536Mi): two cores shared with the cluster, and
  the guest is a busybox initramfs.
- `-kernel`/`-initrd`/`-append` from a read-only hostPath (the e2e guest's
  kernel and one run initrd per script): the examples boot nothing, their
  disk is empty. The hotplug VM's initrd waits for a disk to appear.
- `-serial stdio -no-reboot -nodefaults -display none`, stdin and tty off,
  `restartPolicy: Never`: nobody attaches; the test reads the guest's
  console from the pod's log, and the pod's phase ends with the guest's
  script.
- Claims of 1Gi instead of 10Gi: the test node's pool is small, and the
  guests write at most ~190 MiB.
- Hotplug: the ClusterRoleBinding is named after the test's namespace and
  binds the agent's ServiceAccount there (the example's is in `default`).
"""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest

from csi_qsd.qcow2 import header
from e2e.cluster.conftest import cluster_marks
from testing.cluster import examples as ex
from testing.cluster import up, volume_secrets
from testing.cluster.build import QEMU_IMAGE, cache_root
from testing.cluster.cluster import Cluster
from testing.cluster.deploy import DRIVER_NAMESPACE, driver_pod, get_json, wait_daemonset_ready, wait_until
from testing.guest import build_guest_image, guest_disk_path
from testing.guest.initramfs import EXIT_MARKER, write_run_initrd
from testing.guest.scripts import (
    acknowledged_blocks,
    count_kernel_io_errors,
    guest_script,
    verify_pattern,
    verify_summaries,
    write_pattern,
)

pytestmark = cluster_marks()

SEED = 7
BLOCKS = 64
DISK = guest_disk_path(0)


@pytest.fixture(scope="module")
def guest_dir() -> Path:
    """The guest kernel and run initrds, in a directory the node's pods mount (hostPath, read-only)."""
    image = build_guest_image()
    directory = cache_root() / "vm-pod-guest"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    shutil.copy(image.kernel, directory / "vmlinuz")
    scripts = {
        "write": guest_script(write_pattern(DISK, SEED, BLOCKS), verify_pattern(DISK, SEED, BLOCKS),
                              count_kernel_io_errors()),
        "verify": guest_script(verify_pattern(DISK, SEED, BLOCKS), count_kernel_io_errors()),
        # Long enough (TCG, 2 cores) to span both faults, each block fsynced and acknowledged on the console.
        "faults": guest_script(write_pattern(DISK, SEED + 1, 3000, block_size=65536),
                               verify_pattern(DISK, SEED + 1, 3000, block_size=65536), count_kernel_io_errors()),
    }
    for name, script in scripts.items():
        write_run_initrd(directory / f"{name}.initrd", image.initrd, script, expected_disks=1)
    # Boots with no disk and waits for one to be hot-added (PCIe hotplug), then writes and verifies on it.
    write_run_initrd(directory / "hotplug.initrd", image.initrd, scripts["write"], expected_disks=1, disk_wait_s=400)
    return directory


def _vm_pod(name: str, claim: str, initrd: str, guest: Path) -> dict[str, Any]:
    pod = ex.pick(ex.example("qemu-vhost-user-blk.yaml"), "Pod")
    pod["metadata"]["name"] = name
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = claim
    pod["spec"]["volumes"].append({"name": "guest", "hostPath": {"path": str(guest), "type": "Directory"}})
    container = pod["spec"]["containers"][0]
    args = container["args"][0]
    socket = re.search(r"path=(\S+?),", args)
    assert socket is not None, args
    container.update({
        "image": QEMU_IMAGE, "imagePullPolicy": "Never", "stdin": False, "tty": False,
        "command": ["qemu-system-x86_64"],
        "args": ["-machine", "q35,memory-backend=mem", "-accel", "tcg", "-smp", "1", "-m", "256M",
                 "-object", "memory-backend-memfd,id=mem,size=256M,share=on",
                 "-chardev", f"socket,id=disk0,path={socket.group(1)},reconnect=1",
                 "-device", "vhost-user-blk-pci,chardev=disk0,num-queues=1",
                 "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-no-reboot",
                 "-kernel", "/guest/vmlinuz", "-initrd", f"/guest/{initrd}.initrd",
                 "-append", "console=ttyS0 panic=-1 quiet"],
        "resources": {"requests": {"cpu": "100m", "memory": "384Mi"}, "limits": {"memory": "512Mi"}},
    })
    container["volumeMounts"].append({"name": "guest", "mountPath": "/guest", "readOnly": True})
    return pod


def _run_to_end(cluster: Cluster, namespace: str, pod: dict[str, Any], timeout: float = 300) -> str:
    ex.apply(cluster, namespace, [pod])
    name = pod["metadata"]["name"]
    try:
        wait_until(lambda: get_json(cluster, "-n", namespace, "pod", name)["status"].get("phase")
                   in ("Succeeded", "Failed"), timeout, f"VM pod {name} to finish", interval=2)
    except TimeoutError as error:
        log = cluster.kubectl("logs", "-n", namespace, name, check=False).stdout
        raise TimeoutError(f"{error}; events: {ex.events(cluster, namespace, name)}; console: {log[-3000:]}") from None
    return cluster.kubectl("logs", "-n", namespace, name).stdout


def _claim(cluster: Cluster, namespace: str, storage_class: str = "") -> str:
    pvc = ex.pick(ex.example("qemu-vhost-user-blk.yaml"), "PersistentVolumeClaim")
    pvc["spec"]["resources"]["requests"]["storage"] = "1Gi"
    if storage_class:
        pvc["spec"]["storageClassName"] = storage_class
    ex.apply(cluster, namespace, [pvc])
    return str(pvc["metadata"]["name"])


def _passed(console: str) -> None:
    assert f"{EXIT_MARKER}0" in console, console[-3000:]
    assert "KERNEL_IO_ERRORS 0" in console, console[-3000:]
    summaries = verify_summaries(console)
    assert summaries and all(s.mismatch == 0 and s.ioerrors == 0 for s in summaries), console[-3000:]


def _write_then_verify(cluster: Cluster, namespace: str, claim: str, guest: Path, prefix: str) -> None:
    """One VM pod writes the pattern and reads it back, then a second reads it again."""
    console = _run_to_end(cluster, namespace, _vm_pod(f"{prefix}-write", claim, "write", guest))
    _passed(console)
    assert len(acknowledged_blocks(console, DISK)) == BLOCKS
    console = _run_to_end(cluster, namespace, _vm_pod(f"{prefix}-verify", claim, "verify", guest))
    _passed(console)
    assert verify_summaries(console)[0].ok == BLOCKS


def test_vm_pod_writes_and_a_second_vm_reads_back(cluster: Cluster, test_namespace: str, guest_dir: Path) -> None:
    _write_then_verify(cluster, test_namespace, _claim(cluster, test_namespace), guest_dir, "vm")


# Each image of a volume in the node's pool and the encryption method its qcow2 header names, read by the
# driver's own header reader in the plugin's image.
_CRYPT_METHODS = (
    "import glob, sys\n"
    "from pathlib import Path\n"
    "from csi_qsd.qcow2 import header\n"
    "for path in sorted(glob.glob(f'/var/lib/csi-qsd/pool/{sys.argv[1]}*.qcow2')):\n"
    "    print(path, header.read_file(Path(path)).crypt_method)\n"
)


def test_an_encrypted_vm_claim_writes_and_a_second_vm_reads_back(
        cluster: Cluster, test_namespace: str, guest_dir: Path) -> None:
    """The VM class made encrypted with a real Secret: QSD serves the guest plaintext over vhost-user-blk while
    every image of the volume in the node's pool is LUKS, and the key is in no log line of the plugin."""
    key = secrets.token_urlsafe(32)
    vm_class = ex.pick(ex.example("../storageclasses.yaml"), "StorageClass", "csi-qsd-vm")
    objects = volume_secrets.encrypted_class_objects(test_namespace, f"key-{test_namespace}", key,
                                                     f"enc-vm-{test_namespace}", vm_class["parameters"])
    ex.apply(cluster, test_namespace, objects)
    try:
        claim = _claim(cluster, test_namespace, f"enc-vm-{test_namespace}")
        _write_then_verify(cluster, test_namespace, claim, guest_dir, "vm-enc")
        handle = get_json(cluster, "pv", get_json(cluster, "-n", test_namespace, "pvc", claim)["spec"]["volumeName"]
                          )["spec"]["csi"]["volumeHandle"]
        plugin = driver_pod(cluster)["metadata"]["name"]
        images = cluster.kubectl("exec", "-n", DRIVER_NAMESPACE, plugin, "-c", "csi-qsd", "--",
                                 "/opt/csi-qsd/bin/python", "-c", _CRYPT_METHODS, handle).stdout.split("\n")
        methods = [line.split() for line in images if line.strip()]
        assert methods and all(method == str(header.CRYPT_LUKS) for _path, method in methods), images
        log = cluster.kubectl("logs", "-n", DRIVER_NAMESPACE, plugin, "-c", "csi-qsd").stdout
        assert key not in log
    finally:
        for pod in ("vm-enc-write", "vm-enc-verify"):
            cluster.kubectl("delete", "-n", test_namespace, "pod", pod, "--ignore-not-found", "--wait=true",
                            "--timeout=120s", check=False)
        cluster.kubectl("delete", "-n", test_namespace, "pvc", "--all", "--wait=true", "--timeout=120s", check=False)
        wait_until(lambda: not [p for p in get_json(cluster, "pv")["items"]
                                if p["spec"].get("storageClassName") == f"enc-vm-{test_namespace}"],
                   120, "the encrypted claim's volume gone")
        volume_secrets.delete_objects(cluster, objects)


def _container(name: str, cluster: Cluster) -> dict[str, Any]:
    [status] = [c for c in driver_pod(cluster)["status"]["containerStatuses"] if c["name"] == name]
    return status  # type: ignore[no-any-return]


def _kill_and_wait(cluster: Cluster, name: str) -> None:
    status = _container(name, cluster)
    cluster.ctr("tasks", "kill", "--signal", "SIGKILL", status["containerID"].split("://", 1)[1])
    before = int(status["restartCount"])
    wait_until(lambda: int(_container(name, cluster)["restartCount"]) > before and _container(name, cluster)["ready"],
               180, f"the {name} container to restart", interval=1)
    wait_daemonset_ready(cluster)


@pytest.mark.timeout(2400)  # its own bounds add up to 2280 s: a TCG guest writes 3000 fsynced blocks through two faults
def test_vm_pod_rides_through_plugin_and_qsd_restarts(cluster: Cluster, test_namespace: str, guest_dir: Path) -> None:
    claim = _claim(cluster, test_namespace)
    pod = _vm_pod("vm-faults", claim, "faults", guest_dir)
    ex.apply(cluster, test_namespace, [pod])

    def acked() -> int:
        log = cluster.kubectl("logs", "-n", test_namespace, "vm-faults", check=False).stdout
        return len(acknowledged_blocks(log, DISK))
    wait_until(lambda: acked() >= 50, 240, "the guest's first 50 acknowledged blocks", interval=2)
    _kill_and_wait(cluster, "csi-qsd")
    at = acked()
    wait_until(lambda: acked() >= at + 50, 120, "50 more acknowledged blocks after the plugin restart", interval=2)
    _kill_and_wait(cluster, "qsd")
    at = acked()
    wait_until(lambda: acked() >= at + 50, 180, "50 more acknowledged blocks after QSD's restart", interval=2)
    wait_until(lambda: get_json(cluster, "-n", test_namespace, "pod", "vm-faults")["status"].get("phase")
               in ("Succeeded", "Failed"), 900, "the VM to finish writing and verifying", interval=5)
    console = cluster.kubectl("logs", "-n", test_namespace, "vm-faults").stdout
    _passed(console)
    pod_status = get_json(cluster, "-n", test_namespace, "pod", "vm-faults")["status"]
    assert pod_status["phase"] == "Succeeded" and pod_status["containerStatuses"][0]["restartCount"] == 0


def _qmp(cluster: Cluster, namespace: str, pod: str, *commands: str) -> str:
    """QMP commands to the VM pod's QEMU, one after the other, through socat in the pod; QEMU's answers."""
    feed = "; ".join(f"echo '{c}'; sleep 1" for c in ('{"execute": "qmp_capabilities"}', *commands))
    return ex.pod_exec(cluster, namespace, pod, f"({feed}) | socat -t 5 - UNIX-CONNECT:/run/vm/qmp.sock")


def test_hotplug_example_adds_a_disk_to_a_running_vm(cluster: Cluster, test_namespace: str, guest_dir: Path) -> None:
    """deploy/examples/hotplug.yaml: attachment pod + node agent bind the disk's socket into the running VM's pod,
    and `device_add` hands it to the guest, which writes and reads it back."""
    docs = ex.example("hotplug.yaml")
    vm = ex.pick(docs, "Pod", "csi-qsd-hotplug-vm")
    vm["spec"]["restartPolicy"] = "Never"
    vm["spec"]["volumes"].append({"name": "guest", "hostPath": {"path": str(guest_dir), "type": "Directory"}})
    qemu = vm["spec"]["containers"][0]
    qmp_socket = re.search(r"-qmp unix:(\S+?),", qemu["args"][0])
    assert qmp_socket is not None and qmp_socket.group(1) == "/run/vm/qmp.sock", qemu["args"][0]
    qemu.update({
        "image": QEMU_IMAGE, "imagePullPolicy": "Never", "stdin": False, "tty": False,
        "command": ["qemu-system-x86_64"],
        "args": ["-machine", "q35,memory-backend=mem", "-accel", "tcg", "-smp", "1", "-m", "256M",
                 "-object", "memory-backend-memfd,id=mem,size=256M,share=on",
                 "-device", "pcie-root-port,id=hp-port,chassis=1,slot=1",
                 "-qmp", "unix:/run/vm/qmp.sock,server=on,wait=off",
                 "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-no-reboot",
                 "-kernel", "/guest/vmlinuz", "-initrd", "/guest/hotplug.initrd",
                 "-append", "console=ttyS0 panic=-1 quiet"],
        "resources": {"requests": {"cpu": "100m", "memory": "384Mi"}, "limits": {"memory": "512Mi"}},
    })
    qemu["volumeMounts"].append({"name": "guest", "mountPath": "/guest", "readOnly": True})
    pvc = ex.pick(docs, "PersistentVolumeClaim")
    pvc["spec"]["resources"]["requests"]["storage"] = "1Gi"
    binding = ex.pick(docs, "ClusterRoleBinding")
    binding["metadata"]["name"] = f"csi-qsd-hotplug-agent-{test_namespace}"
    binding["subjects"][0]["namespace"] = test_namespace  # the example's service account is in `default`
    others = [d for d in docs if d["kind"] in ("StorageClass", "ServiceAccount", "ClusterRole", "ConfigMap",
                                               "DaemonSet")]
    ex.apply(cluster, test_namespace, [*others, binding, vm])
    try:
        ex.wait_pod_running(cluster, test_namespace, "csi-qsd-hotplug-vm")
        ex.apply(cluster, test_namespace, [pvc, ex.pick(docs, "Pod", "hp-volume-csi-qsd-hotplug-disk")])
        ex.wait_pod_running(cluster, test_namespace, "hp-volume-csi-qsd-hotplug-disk")
        claim = pvc["metadata"]["name"]
        socket = f"/hotplug-disks/{claim}/vhost-user-blk.sock"
        try:
            wait_until(lambda: ex.pod_exec(cluster, test_namespace, "csi-qsd-hotplug-vm",
                                           f"test -S {socket} && echo yes", timeout=30).strip() == "yes",
                       120, "the node agent to bind the disk's socket into the VM pod", interval=3)
        except TimeoutError as error:
            agent = cluster.kubectl("logs", "-n", test_namespace, "daemonset/csi-qsd-hotplug-agent", "--tail=30",
                                    check=False)
            pods = cluster.kubectl("get", "-n", test_namespace, "pods", "-o", "wide", check=False).stdout
            raise TimeoutError(f"{error}; agent: {agent.stdout[-2000:]}{agent.stderr[-500:]}; pods: {pods}") from None
        answers = _qmp(cluster, test_namespace, "csi-qsd-hotplug-vm",
                       '{"execute": "chardev-add", "arguments": {"id": "hp0", "backend": {"type": "socket", "data": '
                       f'{{"addr": {{"type": "unix", "data": {{"path": "{socket}"}}}}, "server": false, "reconnect": 1}}}}}}}}',
                       '{"execute": "device_add", "arguments": {"driver": "vhost-user-blk-pci", "id": "hp0-disk", '
                       '"chardev": "hp0", "num-queues": 1, "bus": "hp-port"}}')
        assert answers.count('"return"') == 3 and "error" not in answers, answers
        wait_until(lambda: get_json(cluster, "-n", test_namespace, "pod", "csi-qsd-hotplug-vm")["status"].get("phase")
                   in ("Succeeded", "Failed"), 300, "the guest to write and verify the hot-added disk", interval=3)
        console = cluster.kubectl("logs", "-n", test_namespace, "csi-qsd-hotplug-vm").stdout
        _passed(console)
        assert len(acknowledged_blocks(console, DISK)) == BLOCKS
    finally:  # whatever failed (the cluster-scoped class, role and binding go with the namespace: ex.delete_owned)
        # The agent's pods run `sh` as PID 1, which ignores SIGTERM: gone now rather than after 30 s of grace.
        cluster.kubectl("delete", "-n", test_namespace, "daemonset", "csi-qsd-hotplug-agent", "--cascade=foreground",
                        "--grace-period=1", "--timeout=120s", "--ignore-not-found", check=False, timeout=150)


def test_try_it_vm_example_boots_from_its_disk(cluster: Cluster, test_namespace: str) -> None:
    """README's "Try it": `scripts/cluster.sh example qemu-vhost-user-blk.yaml` as printed, applied: the firmware
    reads the empty volume's first sector through the vhost-user-blk socket and finds nothing to boot."""
    docs = up.local_example("qemu-vhost-user-blk.yaml")
    ex.apply(cluster, test_namespace, docs)
    ex.wait_pod_running(cluster, test_namespace, "csi-qsd-qemu-demo")
    log = wait_until(lambda: (text := cluster.kubectl("logs", "-n", test_namespace, "csi-qsd-qemu-demo").stdout)
                     and "No bootable device" in text and text, 120, "SeaBIOS to give up booting")
    assert "Booting from Hard Disk...\nBoot failed: not a bootable disk" in log.replace("\r", ""), log[-2000:]
