"""deploy/examples: claims use the base's classes, data sources resolve, the
vhost-user-blk consumers open the socket the driver publishes, and the
KubeVirt hook script produces the libvirt disk it is meant to."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from testing.manifests.objects import SOCKET_NAME, Obj, one, pod_specs, properties, pvc_claims, qemu_options, select

HOOKS_ANNOTATION = "hooks.kubevirt.io/hookSidecars"
KVM_RESOURCE = "devices.kubevirt.io/kvm"


def quantity_bytes(value: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", value)
    assert match, f"unsupported quantity {value}"
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def storage_class_of(pvc: Obj) -> str:
    name: str = pvc["spec"]["storageClassName"]
    return name


def test_claims_use_the_driver_classes(base: list[Obj], examples: list[Obj]) -> None:
    classes = {sc["metadata"]["name"]: sc for sc in select(base, "StorageClass")}
    claims = select(examples, "PersistentVolumeClaim")
    assert claims
    for pvc in claims:
        sc = classes[storage_class_of(pvc)]
        mode = pvc["spec"].get("volumeMode", "Filesystem")
        access = pvc["spec"]["accessModes"]
        assert set(access) <= {"ReadWriteOnce", "ReadWriteOncePod"}, "node-local volumes are single-node"
        if sc["metadata"]["name"] == "csi-qsd-block":
            assert mode == "Block"
        else:
            assert mode == "Filesystem", "vhost-user-blk and filesystem volumes are directories"


def test_every_class_has_an_example(base: list[Obj], examples: list[Obj]) -> None:
    used = {storage_class_of(pvc) for pvc in select(examples, "PersistentVolumeClaim")}
    assert used == {sc["metadata"]["name"] for sc in select(base, "StorageClass")}


def test_pods_mount_existing_claims_the_right_way(examples: list[Obj]) -> None:
    claims = {pvc["metadata"]["name"]: pvc for pvc in select(examples, "PersistentVolumeClaim")}
    for obj, spec in pod_specs(examples):
        by_volume = pvc_claims(spec)
        for volume, claim in by_volume.items():
            assert claim in claims, f"{obj['metadata']['name']} uses unknown claim {claim}"
            block = claims[claim]["spec"].get("volumeMode") == "Block"
            for c in spec["containers"]:
                mounted = {m["name"] for m in c.get("volumeMounts") or []}
                devices = {d["name"] for d in c.get("volumeDevices") or []}
                if block:
                    assert volume not in mounted, "a Block claim is a device, not a mount"
                else:
                    assert volume not in devices, "a Filesystem claim cannot be a device"


def source_pod_labels(examples: list[Obj], claim: str) -> list[dict[str, str]]:
    """Labels of the example pods that mount `claim`."""
    return [
        obj["metadata"].get("labels") or {}
        for obj, spec in pod_specs(examples)
        if claim in pvc_claims(spec).values()
    ]


@pytest.mark.parametrize("kind", ["VolumeSnapshot", "PersistentVolumeClaim"])
def test_data_sources_resolve_and_stay_on_the_source_node(examples: list[Obj], kind: str) -> None:
    claims = {pvc["metadata"]["name"]: pvc for pvc in select(examples, "PersistentVolumeClaim")}
    snapshots = {s["metadata"]["name"]: s for s in select(examples, "VolumeSnapshot")}
    restored = [pvc for pvc in claims.values() if (pvc["spec"].get("dataSource") or {}).get("kind") == kind]
    assert restored, f"no example restores from a {kind}"
    for pvc in restored:
        source = pvc["spec"]["dataSource"]
        if kind == "VolumeSnapshot":
            assert source["apiGroup"] == "snapshot.storage.k8s.io"
            source_claim = snapshots[source["name"]]["spec"]["source"]["persistentVolumeClaimName"]
        else:
            assert source.get("apiGroup", "") == ""
            source_claim = source["name"]
        original = claims[source_claim]
        assert storage_class_of(pvc) == storage_class_of(original)
        assert pvc["spec"].get("volumeMode") == original["spec"].get("volumeMode")
        assert quantity_bytes(pvc["spec"]["resources"]["requests"]["storage"]) >= quantity_bytes(
            original["spec"]["resources"]["requests"]["storage"]
        )
        # The new volume must be created where the source lives: its pod
        # follows a pod of the source claim.
        consumers = [spec for _, spec in pod_specs(examples) if pvc["metadata"]["name"] in pvc_claims(spec).values()]
        assert consumers
        for spec in consumers:
            terms = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert any(
                term["topologyKey"] == "kubernetes.io/hostname"
                and any(
                    term["labelSelector"]["matchLabels"].items() <= labels.items() and labels
                    for labels in source_pod_labels(examples, source_claim)
                )
                for term in terms
            ), f"{pvc['metadata']['name']}'s pod does not follow the source's pod"


def test_snapshot_uses_the_snapshot_class(base: list[Obj], examples: list[Obj]) -> None:
    classes = {vsc["metadata"]["name"] for vsc in select(base, "VolumeSnapshotClass")}
    claims = {pvc["metadata"]["name"] for pvc in select(examples, "PersistentVolumeClaim")}
    for snapshot in select(examples, "VolumeSnapshot"):
        assert snapshot["spec"]["volumeSnapshotClassName"] in classes
        assert snapshot["spec"]["source"]["persistentVolumeClaimName"] in claims


# ---------------------------------------------------------------------------
# Plain QEMU opening the vhost-user-blk socket.


def test_qemu_pod_opens_the_published_socket(base: list[Obj], examples: list[Obj]) -> None:
    pod = one(examples, "Pod", "csi-qsd-qemu-demo")
    (qemu,) = pod["spec"]["containers"]
    command = " ".join(qemu.get("command", []) + qemu.get("args", []))
    options = qemu_options(command)

    claims = pvc_claims(pod["spec"])
    ((volume, claim),) = claims.items()
    pvc = one(examples, "PersistentVolumeClaim", claim)
    sc = one(base, "StorageClass", storage_class_of(pvc))
    assert sc["parameters"]["export"] == "vhost-user-blk"
    (mount,) = [m for m in qemu["volumeMounts"] if m["name"] == volume]
    assert mount["mountPath"] == "/vm-disk"

    chardevs = {}
    for value in options["-chardev"]:
        backend, props = properties(value)
        assert backend == "socket"
        chardevs[props["id"]] = props
    (device,) = [properties(v) for v in options["-device"] if v.startswith("vhost-user-blk-pci")]
    socket = chardevs[device[1]["chardev"]]
    assert socket["path"] == f"{mount['mountPath']}/{SOCKET_NAME}"
    assert socket.get("reconnect"), "reconnect keeps the disk across a QSD restart"
    assert int(device[1]["num-queues"]) <= int(sc["parameters"]["numQueues"])

    # vhost-user needs guest RAM shared with QSD.
    (memory,) = [properties(v)[1] for v in options["-object"] if v.startswith("memory-backend-memfd")]
    assert memory["share"] == "on"
    machine = properties(options["-machine"][0])[1]
    assert machine["memory-backend"] == memory["id"]
    assert quantity_bytes(memory["size"].replace("G", "Gi").replace("M", "Mi")) == quantity_bytes(
        options["-m"][0].replace("G", "Gi").replace("M", "Mi")
    )
    assert machine.get("accel") == "kvm"
    assert qemu["resources"]["limits"][KVM_RESOURCE] == "1"


# ---------------------------------------------------------------------------
# KubeVirt: the hook sidecar and its onDefineDomain script.


@pytest.fixture
def vm(examples: list[Obj]) -> Obj:
    return one(examples, "VirtualMachine", "csi-qsd-vm-demo")


def hooks(vm: Obj) -> list[Obj]:
    value = vm["spec"]["template"]["metadata"]["annotations"][HOOKS_ANNOTATION]
    parsed = json.loads(value)
    assert isinstance(parsed, list)
    return parsed


def test_vm_disks_and_volumes_match(vm: Obj) -> None:
    spec = vm["spec"]["template"]["spec"]
    disks = [d["name"] for d in spec["domain"]["devices"]["disks"]]
    volumes = [v["name"] for v in spec["volumes"]]
    assert len(set(disks)) == len(disks)
    assert sorted(disks) == sorted(volumes)


def test_vm_hook_shares_a_vm_class_claim(base: list[Obj], examples: list[Obj], vm: Obj) -> None:
    entries = hooks(vm)
    assert entries
    for entry in entries:
        assert entry["args"] == ["--version", "v1alpha2"]
        config_map = entry["configMap"]
        assert config_map["hookPath"] == "/usr/bin/onDefineDomain"
        cm = one(examples, "ConfigMap", config_map["name"])
        assert cm["data"][config_map["key"]].startswith("#!/usr/bin/env python3\n")
        pvc = one(examples, "PersistentVolumeClaim", entry["pvc"]["name"])
        sc = one(base, "StorageClass", storage_class_of(pvc))
        assert sc["parameters"]["export"] == "vhost-user-blk"
        for key in ("volumePath", "sharedComputePath"):
            assert entry["pvc"][key].startswith("/")
    queues = vm["spec"]["template"]["metadata"]["annotations"].get("csi-qsd.io/vhost-user-blk-queues", "1")
    for entry in entries:
        sc = one(base, "StorageClass", storage_class_of(one(examples, "PersistentVolumeClaim", entry["pvc"]["name"])))
        assert int(queues) <= int(sc["parameters"]["numQueues"])


DOMAIN = """<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0">
  <name>default_csi-qsd-vm-demo</name>
  <metadata><kubevirt:kubevirt xmlns:kubevirt="http://kubevirt.io"><kubevirt:uid>1</kubevirt:uid></kubevirt:kubevirt></metadata>
  <memory unit="b">2147483648</memory>
  <devices>
    <disk device="disk" type="file"><source file="/var/run/kubevirt-ephemeral-disks/disk-data/rootdisk/disk.qcow2"/><target bus="virtio" dev="vda"/></disk>
    <disk device="disk" type="file"><source file="/var/run/kubevirt-ephemeral-disks/cloud-init-data/noCloud.iso"/><target bus="virtio" dev="vdb"/></disk>
    <interface type="ethernet"><target dev="tap0" managed="no"/></interface>
  </devices>
  <qemu:commandline><qemu:arg value="-no-user-config"/></qemu:commandline>
</domain>"""


def run_hook(script: Path, vmi: Obj, domain: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), "--vmi", json.dumps(vmi), "--domain", domain],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def hook_script(examples: list[Obj], vm: Obj, tmp_path: Path) -> Path:
    (entry,) = hooks(vm)
    cm = one(examples, "ConfigMap", entry["configMap"]["name"])
    path = tmp_path / "onDefineDomain"
    path.write_text(cm["data"][entry["configMap"]["key"]], encoding="utf-8")
    return path


def vmi_of(vm: Obj) -> Obj:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": vm["spec"]["template"]["metadata"]}


def test_hook_adds_the_vhost_user_disk(hook_script: Path, vm: Obj) -> None:
    result = run_hook(hook_script, vmi_of(vm), DOMAIN)
    assert result.returncode == 0, result.stderr
    domain = ET.fromstring(result.stdout)
    (disk,) = domain.findall("devices/disk[@type='vhostuser']")
    (entry,) = hooks(vm)
    source = disk.find("source")
    assert source is not None
    assert source.attrib == {"type": "unix", "path": f"{entry['pvc']['sharedComputePath']}/{SOCKET_NAME}"}
    reconnect = source.find("reconnect")
    assert reconnect is not None and reconnect.get("enabled") == "yes"
    target = disk.find("target")
    assert target is not None and target.attrib == {"dev": "vdc", "bus": "virtio"}
    driver = disk.find("driver")
    assert driver is not None and driver.get("queues") == "1"
    assert domain.find("memoryBacking/source[@type='memfd']") is not None
    assert domain.find("memoryBacking/access[@mode='shared']") is not None
    # The other disks and the qemu/kubevirt namespaces survive.
    assert len(domain.findall("devices/disk")) == 3
    assert "xmlns:qemu=\"http://libvirt.org/schemas/domain/qemu/1.0\"" in result.stdout
    assert domain.find("{http://libvirt.org/schemas/domain/qemu/1.0}commandline") is not None
    assert domain.find("metadata/{http://kubevirt.io}kubevirt") is not None

    again = run_hook(hook_script, vmi_of(vm), result.stdout)
    assert again.returncode == 0, again.stderr
    assert len(ET.fromstring(again.stdout).findall("devices/disk[@type='vhostuser']")) == 1


def test_hook_leaves_vms_without_claims_alone(hook_script: Path) -> None:
    result = run_hook(hook_script, {"metadata": {"annotations": {}}}, DOMAIN)
    assert result.returncode == 0, result.stderr
    domain = ET.fromstring(result.stdout)
    assert not domain.findall("devices/disk[@type='vhostuser']")
    assert domain.find("memoryBacking") is None


def test_hook_rejects_bad_queue_count(hook_script: Path, vm: Obj) -> None:
    vmi = vmi_of(vm)
    vmi["metadata"] = dict(vmi["metadata"], annotations=dict(vmi["metadata"]["annotations"]))
    vmi["metadata"]["annotations"]["csi-qsd.io/vhost-user-blk-queues"] = "0"
    result = run_hook(hook_script, vmi, DOMAIN)
    assert result.returncode != 0
