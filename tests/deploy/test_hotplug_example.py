"""deploy/examples/hotplug.yaml: the attachment pod, the VM pod and the node agent fit together."""

from __future__ import annotations

from testing.manifests.objects import Obj, one, pvc_claims, select


def test_attachment_pod_lands_beside_its_vm_with_the_vmm_group(base: list[Obj], examples: list[Obj]) -> None:
    attach = one(examples, "Pod", "hp-volume-csi-qsd-hotplug-disk")
    vm_name = attach["metadata"]["labels"]["csi-qsd.io/hotplug-for"]
    vm = one(examples, "Pod", vm_name)
    (term,) = attach["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= vm["metadata"]["labels"].items()
    (claim,) = pvc_claims(attach["spec"]).values()
    pvc = one(examples, "PersistentVolumeClaim", claim)
    sc = one(base, "StorageClass", pvc["spec"]["storageClassName"])
    assert sc["parameters"]["export"] == "vhost-user-blk"
    assert attach["spec"]["securityContext"]["fsGroup"] == 107, "the socket's group must be the VMM's"
    hotplug_class = one(examples, "StorageClass", "csi-qsd-vm-hotplug")
    assert hotplug_class["parameters"] == {"export": "vhost-user-blk", "vmmGroup": "107"}


def test_vm_pod_sees_the_agents_binds_and_can_hot_add(examples: list[Obj]) -> None:
    vm = one(examples, "Pod", "csi-qsd-hotplug-vm")
    (qemu,) = vm["spec"]["containers"]
    (mount,) = [m for m in qemu["volumeMounts"] if m["name"] == "hotplug-disks"]
    assert mount["mountPropagation"] == "HostToContainer", "binds made after the start must show inside"
    command = " ".join(qemu["args"])
    assert "pcie-root-port,id=hp-port" in command and "-qmp unix:/run/vm/qmp.sock" in command
    assert "share=on" in command


def test_agent_binds_into_the_vm_pods_hotplug_directory(examples: list[Obj]) -> None:
    (ds,) = select(examples, "DaemonSet", "csi-qsd-hotplug-agent")
    spec = ds["spec"]["template"]["spec"]
    (agent,) = spec["containers"]
    (pods,) = [m for m in agent["volumeMounts"] if m["name"] == "pods"]
    assert pods["mountPath"] == "/var/lib/kubelet/pods" and pods["mountPropagation"] == "Bidirectional"
    assert agent["securityContext"]["privileged"] is True
    script = one(examples, "ConfigMap", "csi-qsd-hotplug-agent")["data"]["agent.sh"]
    assert "volumes/kubernetes.io~empty-dir/hotplug-disks/" in script and "mount --bind" in script
    assert "umount" in script
