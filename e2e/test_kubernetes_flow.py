"""The Kubernetes flow, end to end, against `csi-qsd serve` over its socket.

No cluster: the test plays each Kubernetes component with the objects in
deploy/ (rendered by the tests/deploy kustomize renderer) and makes the CSI
calls that component makes, with the arguments it would build:

* node-driver-registrar: GetPluginInfo and NodeGetInfo; the node's
  accessible_topology becomes node labels and the CSINode's topology keys.
* external-provisioner, configured as deploy/node.yaml configures it
  (distributed, --strict-topology, capacity tracking): GetCapacity with the
  class's parameters and the node's segment; CreateVolume named
  `pvc-<PVC uid>` with the class's parameters minus the reserved
  `csi.storage.k8s.io/` keys (the fstype key becomes the mount capability's
  fs_type), one capability per access mode of the PVC, the PVC's requested
  size, and the selected node's topology as requisite and preferred; the PV
  it would write (validated against the Kubernetes schema); DeleteVolume once
  the claim is gone (reclaimPolicy Delete).
* kubelet: NodeGetCapabilities; NodeStageVolume to
  `<kubelet>/plugins/kubernetes.io/csi/<driver>/<sha256(volume handle)>/globalmount`;
  NodePublishVolume to `<kubelet>/pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount`,
  both with the PV's volume attributes (publish adds the pod's info,
  podInfoOnMount) and the pod's fsGroup as volume_mount_group (fsGroupPolicy
  File + the VOLUME_MOUNT_GROUP capability); NodeGetVolumeStats; then
  NodeUnpublishVolume and NodeUnstageVolume.

The workloads are the examples' own: the plain-QEMU pod's `-chardev` and
`-device vhost-user-blk-pci` arguments open the published socket and boot the
e2e guest, which writes and reads back a pattern (while /metrics is scraped);
the filesystem pod's command writes into the published mount as the pod's
user. A third test creates a volume with every StorageClass's parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from e2e.conftest import e2e_marks
from testing.guest import (
    GuestImage,
    VhostUserDisk,
    count_kernel_io_errors,
    guest_script,
    pattern_block,
    start_vm,
    verify_pattern,
    verify_summaries,
    write_pattern,
)
from testing.harness import DriverProcess, free_port, until
from testing.helpers.metrics_scrape import scrape
from testing.manifests.kustomize import load_yaml_documents, render
from testing.manifests.objects import (
    DEPLOY_DIR,
    EXAMPLES_DIR,
    Obj,
    container,
    flag_values,
    has_switch,
    one,
    properties,
    pvc_claims,
    qemu_options,
    resolve_mount,
    select,
)
from testing.served import Served, run, serving

pytestmark = e2e_marks(("qemu-system-x86_64", "qemu-storage-daemon", "qemu-img", "losetup", "mkfs.ext4", "mount"))

MIB = 1 << 20
VM_TIMEOUT_S = 120.0
RESERVED_PREFIX = "csi.storage.k8s.io/"
FSTYPE_KEY = "csi.storage.k8s.io/fstype"
PROVISIONER_IDENTITY_KEY = "storage.kubernetes.io/csiProvisionerIdentity"
VM_EXAMPLE = "qemu-vhost-user-blk.yaml"
FS_EXAMPLE = "filesystem-pod.yaml"
Mode = pb.VolumeCapability.AccessMode.Mode
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(value))
    assert match, f"unsupported quantity {value!r}"
    return int(match.group(1)) * _UNITS.get(match.group(2) or "", 1)


def requested_bytes(pvc: Obj) -> int:
    return quantity_bytes(pvc["spec"]["resources"]["requests"]["storage"])


# ---------------------------------------------------------------------------
# The objects in deploy/


@dataclass
class Deploy:
    base: list[Obj]
    examples: list[Obj]

    @classmethod
    def load(cls) -> Deploy:
        return cls(render(DEPLOY_DIR), render(EXAMPLES_DIR))

    @property
    def csidriver(self) -> Obj:
        return one(self.base, "CSIDriver")

    @property
    def driver_name(self) -> str:
        name: str = self.csidriver["metadata"]["name"]
        return name

    def storage_class(self, name: str) -> Obj:
        return one(self.base, "StorageClass", name)

    def sidecar_args(self, name: str) -> list[str]:
        pod = one(self.base, "DaemonSet")["spec"]["template"]["spec"]
        args: list[str] = container(pod, name)["args"]
        return args

    def example(self, file: str) -> tuple[Obj, Obj]:
        """(PVC, Pod) defined in deploy/examples/`file`, as rendered from the examples' kustomization."""
        names = {(doc["kind"], doc["metadata"]["name"]) for doc in load_yaml_documents(EXAMPLES_DIR / file)}
        (pvc_name,) = [name for kind, name in names if kind == "PersistentVolumeClaim"]
        (pod_name,) = [name for kind, name in names if kind == "Pod"]
        pvc = copy.deepcopy(one(self.examples, "PersistentVolumeClaim", pvc_name))
        pod = copy.deepcopy(one(self.examples, "Pod", pod_name))
        # What the API server adds on creation (kubectl apply into "default").
        for obj in (pvc, pod):
            obj["metadata"].setdefault("namespace", "default")
            obj["metadata"]["uid"] = str(uuid.uuid4())
        pod["spec"].setdefault("serviceAccountName", "default")
        assert pvc_name in pvc_claims(pod["spec"]).values()
        return pvc, pod


@pytest.fixture(scope="module")
def deploy() -> Deploy:
    return Deploy.load()


# ---------------------------------------------------------------------------
# The Kubernetes components, as far as the CSI calls go


def rpc_types(caps: Any) -> set[int]:
    """The RPC types among a GetCapabilities response's capabilities."""
    return {cap.rpc.type for cap in caps if cap.WhichOneof("type") == "rpc"}


def to_csi_access_mode(mode: str, single_node_multi_writer: bool) -> Any:
    """k8s.io/csi-translation-lib ToCSIAccessMode, as both the provisioner and kubelet use it."""
    if mode == "ReadWriteOnce":
        return Mode.SINGLE_NODE_MULTI_WRITER if single_node_multi_writer else Mode.SINGLE_NODE_WRITER
    if mode == "ReadWriteOncePod":
        return Mode.SINGLE_NODE_SINGLE_WRITER if single_node_multi_writer else Mode.SINGLE_NODE_WRITER
    if mode == "ReadOnlyMany":
        return Mode.MULTI_NODE_READER_ONLY
    if mode == "ReadWriteMany":
        return Mode.MULTI_NODE_MULTI_WRITER
    raise AssertionError(f"unknown access mode {mode}")


@dataclass
class Node:
    """The node as the registrar leaves it: ID, labels (topology segments) and CSINode topology keys."""

    node_id: str
    segments: dict[str, str]

    @property
    def labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.node_id, **self.segments}


async def register(csi: CSIClient, deploy: Deploy) -> Node:
    """node-driver-registrar, then kubelet's registration of the plugin."""
    info = await csi.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == deploy.driver_name, "kubelet registers the plugin under GetPluginInfo's name"
    node = await csi.node.NodeGetInfo(pb.NodeGetInfoRequest())
    assert node.node_id
    segments = dict(node.accessible_topology.segments)
    assert segments, "the driver is topology-aware: NodeGetInfo must report the node's segment"
    return Node(node.node_id, segments)


class Provisioner:
    """external-provisioner with the arguments deploy/node.yaml gives it, on the node it runs on."""

    def __init__(self, csi: CSIClient, deploy: Deploy, node: Node) -> None:
        self.csi = csi
        self.deploy = deploy
        self.node = node
        args = deploy.sidecar_args("csi-provisioner")
        assert has_switch(args, "--node-deployment") and has_switch(args, "--strict-topology")
        assert has_switch(args, "--enable-capacity")
        self.extra_create_metadata = has_switch(args, "--extra-create-metadata")
        self.prefix = (flag_values(args, "--volume-name-prefix") or ["pvc"])[0]
        assert not flag_values(args, "--volume-name-uuid-length"), "the test builds names with the full UID"
        assert not flag_values(args, "--default-fstype"), "the test assumes no default fstype"
        self.identity = f"{int(time.time() * 1000)}-{os.getpid() % 10000}-{deploy.driver_name}"
        self.single_node_multi_writer = False

    async def start(self) -> None:
        plugin = await self.csi.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
        services = {cap.service.type for cap in plugin.capabilities if cap.WhichOneof("type") == "service"}
        Service = pb.PluginCapability.Service
        assert Service.CONTROLLER_SERVICE in services, "provisioning needs the controller service"
        assert Service.VOLUME_ACCESSIBILITY_CONSTRAINTS in services, "--strict-topology needs topology support"
        caps = await self.csi.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
        rpcs = rpc_types(caps.capabilities)
        RPC = pb.ControllerServiceCapability.RPC
        assert RPC.CREATE_DELETE_VOLUME in rpcs and RPC.GET_CAPACITY in rpcs
        self.single_node_multi_writer = RPC.SINGLE_NODE_MULTI_WRITER in rpcs

    def segment(self) -> pb.Topology:
        return pb.Topology(segments=self.node.segments)

    async def capacity(self, sc: Obj) -> int:
        """The capacity controller's GetCapacity for this node's segment (class parameters as they are)."""
        response = await self.csi.controller.GetCapacity(pb.GetCapacityRequest(
            parameters=sc.get("parameters") or {}, accessible_topology=self.segment(),
        ))
        return int(response.available_capacity)

    def create_request(self, pvc: Obj, sc: Obj) -> tuple[pb.CreateVolumeRequest, str]:
        """(CreateVolumeRequest, fsType) exactly as prepareProvision builds them."""
        params: dict[str, str] = dict(sc.get("parameters") or {})
        fs_type = params.get(FSTYPE_KEY, "")
        stripped = {k: v for k, v in params.items() if not k.startswith(RESERVED_PREFIX)}
        name = f"{self.prefix}-{pvc['metadata']['uid']}"
        if self.extra_create_metadata:
            stripped.update({
                "csi.storage.k8s.io/pvc/name": pvc["metadata"]["name"],
                "csi.storage.k8s.io/pvc/namespace": pvc["metadata"]["namespace"],
                "csi.storage.k8s.io/pv/name": name,
            })
        block = pvc["spec"].get("volumeMode", "Filesystem") == "Block"
        caps = []
        for mode in pvc["spec"]["accessModes"]:
            access = pb.VolumeCapability.AccessMode(mode=to_csi_access_mode(mode, self.single_node_multi_writer))
            if block:
                caps.append(pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=access))
            else:
                caps.append(pb.VolumeCapability(
                    mount=pb.VolumeCapability.MountVolume(fs_type=fs_type, mount_flags=sc.get("mountOptions") or []),
                    access_mode=access,
                ))
        request = pb.CreateVolumeRequest(
            name=name,
            capacity_range=pb.CapacityRange(required_bytes=requested_bytes(pvc)),
            volume_capabilities=caps,
            parameters=stripped,
            accessibility_requirements=pb.TopologyRequirement(requisite=[self.segment()], preferred=[self.segment()]),
        )
        return request, fs_type

    async def provision(self, pvc: Obj, sc: Obj) -> Obj:
        """CreateVolume for `pvc` on this node; returns the PersistentVolume the provisioner would create."""
        assert sc["provisioner"] == self.deploy.driver_name
        assert sc["volumeBindingMode"] == "WaitForFirstConsumer", "distributed provisioning needs late binding"
        request, fs_type = self.create_request(pvc, sc)
        assert await self.capacity(sc) >= request.capacity_range.required_bytes, "the scheduler would not pick us"
        volume = (await self.csi.controller.CreateVolume(request)).volume
        assert volume.volume_id
        assert volume.capacity_bytes >= request.capacity_range.required_bytes
        again = (await self.csi.controller.CreateVolume(request)).volume  # a retried call: same volume
        assert again.volume_id == volume.volume_id
        assert volume.accessible_topology, "a node-local volume must say where it is"
        for topology in volume.accessible_topology:
            assert set(topology.segments.items()) <= set(self.node.labels.items()), (
                f"volume topology {dict(topology.segments)} does not match node {self.node.labels}")
        attributes = {PROVISIONER_IDENTITY_KEY: self.identity, **dict(volume.volume_context)}
        csi_source: Obj = {"driver": self.deploy.driver_name, "volumeHandle": volume.volume_id,
                           "volumeAttributes": attributes}
        block = pvc["spec"].get("volumeMode", "Filesystem") == "Block"
        if not block and fs_type:
            csi_source["fsType"] = fs_type
        pv: Obj = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": request.name, "annotations": {"pv.kubernetes.io/provisioned-by": sc["provisioner"]}},
            "spec": {
                "accessModes": list(pvc["spec"]["accessModes"]),
                "capacity": {"storage": str(volume.capacity_bytes)},
                "csi": csi_source,
                "persistentVolumeReclaimPolicy": sc.get("reclaimPolicy", "Delete"),
                "storageClassName": sc["metadata"]["name"],
                "volumeMode": pvc["spec"].get("volumeMode", "Filesystem"),
                "claimRef": {"kind": "PersistentVolumeClaim", "namespace": pvc["metadata"]["namespace"],
                             "name": pvc["metadata"]["name"], "uid": pvc["metadata"]["uid"]},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": k, "operator": "In", "values": [v]}
                                          for k, v in sorted(t.segments.items())]}
                    for t in volume.accessible_topology
                ]}},
            },
        }
        if sc.get("mountOptions"):
            pv["spec"]["mountOptions"] = list(sc["mountOptions"])
        kubernetes_validate.validate(pv, kubernetes_validate.latest_version(), strict=True)
        assert node_affinity_matches(pv, self.node), "the PV would keep its pods off the node that holds it"
        return pv

    async def delete(self, pv: Obj) -> None:
        assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
        request = pb.DeleteVolumeRequest(volume_id=pv["spec"]["csi"]["volumeHandle"])
        await self.csi.controller.DeleteVolume(request)
        await self.csi.controller.DeleteVolume(request)  # retried: a deleted volume is success


def node_affinity_matches(pv: Obj, node: Node) -> bool:
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    return any(all(node.labels.get(e["key"]) in e["values"] for e in term["matchExpressions"]) for term in terms)


class Kubelet:
    """The CSI calls kubelet makes to run one pod with one CSI volume."""

    def __init__(self, csi: CSIClient, deploy: Deploy, root: Path) -> None:
        self.csi = csi
        self.deploy = deploy
        self.root = root
        self.stage_unstage = False
        self.mount_group = False
        self.single_node_multi_writer = False

    async def start(self) -> None:
        caps = await self.csi.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest())
        rpcs = rpc_types(caps.capabilities)
        RPC = pb.NodeServiceCapability.RPC
        self.stage_unstage = RPC.STAGE_UNSTAGE_VOLUME in rpcs
        self.mount_group = RPC.VOLUME_MOUNT_GROUP in rpcs
        self.single_node_multi_writer = RPC.SINGLE_NODE_MULTI_WRITER in rpcs
        assert self.stage_unstage, "the driver stages (FUSE export, loop device, mkfs) before publishing"

    def staging_path(self, pv: Obj) -> Path:
        handle: str = pv["spec"]["csi"]["volumeHandle"]
        digest = hashlib.sha256(handle.encode()).hexdigest()
        return self.root / "plugins" / "kubernetes.io" / "csi" / self.deploy.driver_name / digest / "globalmount"

    def target_path(self, pod: Obj, pv: Obj) -> Path:
        pod_uid: str = pod["metadata"]["uid"]
        pv_name: str = pv["metadata"]["name"]
        return self.root / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / pv_name / "mount"

    def capability(self, pv: Obj, pod: Obj) -> pb.VolumeCapability:
        (mode,) = {to_csi_access_mode(m, self.single_node_multi_writer) for m in pv["spec"]["accessModes"]}
        access = pb.VolumeCapability.AccessMode(mode=mode)
        if pv["spec"]["volumeMode"] == "Block":
            return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=access)
        group = ""
        fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        policy = self.deploy.csidriver["spec"].get("fsGroupPolicy", "ReadWriteOnceWithFSType")
        if self.mount_group and fs_group is not None and policy != "None":
            assert policy == "File", "with ReadWriteOnceWithFSType kubelet would only pass it with an fsType"
            group = str(fs_group)
        return pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(fs_type=pv["spec"]["csi"].get("fsType", ""),
                                                  mount_flags=pv["spec"].get("mountOptions") or [],
                                                  volume_mount_group=group),
            access_mode=access,
        )

    def publish_context(self, pv: Obj, pod: Obj) -> dict[str, str]:
        attributes = dict(pv["spec"]["csi"]["volumeAttributes"])
        if self.deploy.csidriver["spec"].get("podInfoOnMount"):
            attributes.update({
                "csi.storage.k8s.io/pod.name": pod["metadata"]["name"],
                "csi.storage.k8s.io/pod.namespace": pod["metadata"]["namespace"],
                "csi.storage.k8s.io/pod.uid": pod["metadata"]["uid"],
                "csi.storage.k8s.io/serviceAccount.name": pod["spec"]["serviceAccountName"],
                "csi.storage.k8s.io/ephemeral": "false",
            })
        return attributes

    async def mount(self, pv: Obj, pod: Obj) -> Path:
        """MountDevice (NodeStageVolume) and SetUp (NodePublishVolume); returns the target path."""
        assert not self.deploy.csidriver["spec"]["attachRequired"], "no VolumeAttachment, no publish_context"
        handle = pv["spec"]["csi"]["volumeHandle"]
        capability = self.capability(pv, pod)
        staging = self.staging_path(pv)
        staging.mkdir(parents=True, exist_ok=True, mode=0o750)
        await self.csi.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=handle, publish_context={}, staging_target_path=str(staging), volume_capability=capability,
            volume_context=pv["spec"]["csi"]["volumeAttributes"],
        ))
        target = self.target_path(pod, pv)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o750)  # kubelet creates the parent only
        request = pb.NodePublishVolumeRequest(
            volume_id=handle, publish_context={}, staging_target_path=str(staging), target_path=str(target),
            volume_capability=capability, readonly=False, volume_context=self.publish_context(pv, pod),
        )
        await self.csi.node.NodePublishVolume(request)
        await self.csi.node.NodePublishVolume(request)  # kubelet retries after a timeout: must succeed
        return target

    async def stats(self, pv: Obj, target: Path) -> pb.NodeGetVolumeStatsResponse:
        response = await self.csi.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=pv["spec"]["csi"]["volumeHandle"], volume_path=str(target),
            staging_target_path=str(self.staging_path(pv)),
        ))
        assert not response.volume_condition.abnormal, response.volume_condition.message
        return response  # type: ignore[no-any-return]

    async def unmount(self, pv: Obj, pod: Obj) -> None:
        """TearDown (NodeUnpublishVolume), then UnmountDevice (NodeUnstageVolume), in kubelet's order."""
        handle = pv["spec"]["csi"]["volumeHandle"]
        target = self.target_path(pod, pv)
        await self.csi.node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(target)))
        assert not os.path.ismount(target)
        if target.is_dir():
            target.rmdir()  # kubelet removes the mount dir the plugin may leave
        shutil.rmtree(target.parent)
        staging = self.staging_path(pv)
        await self.csi.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=handle,
                                                                          staging_target_path=str(staging)))
        assert not os.path.ismount(staging)
        shutil.rmtree(staging.parent)


# ---------------------------------------------------------------------------
# Driver under test


async def metric(port: int, name: str, **labels: str) -> float | None:
    """One sample from the driver's /metrics (None if absent)."""
    return (await scrape(port)).samples.get(name, {}).get(frozenset(labels.items()))


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.fixture
async def served(metrics_port: int) -> AsyncIterator[Served[DriverProcess]]:
    async with serving("--metrics-address", f"127.0.0.1:{metrics_port}", fuse=True, timeout=120) as value:
        yield value


@contextlib.contextmanager
def container_view(root: Path, mount_path: str, published: Path) -> Iterator[Path]:
    """A container's root with the published volume at `mount_path`, bind-mounted as the runtime does.

    Processes then use the example's own paths under the returned root. For
    the VM this is required, not cosmetic: the published host path of the
    socket (<kubelet>/pods/<uid>/volumes/kubernetes.io~csi/pvc-<uid>/mount/
    vhost-user-blk.sock, 151 bytes under /var/lib/kubelet) is longer than a
    UNIX socket address can be (107 bytes), so a consumer must open it
    through its mount inside the pod, never through the host path.
    """
    point = root / mount_path.lstrip("/")
    point.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(published), str(point)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", str(point)], check=True)


async def setup_components(served: Served[DriverProcess], deploy: Deploy) -> tuple[Node, Provisioner, Kubelet]:
    node = await register(served.csi, deploy)
    provisioner = Provisioner(served.csi, deploy, node)
    await provisioner.start()
    kubelet = Kubelet(served.csi, deploy, served.box.kubelet)
    await kubelet.start()
    return node, provisioner, kubelet


def image_of(served: Served[DriverProcess], pv: Obj) -> Path:
    """The volume's image in the pool (default pool dir: <state>/pool), for checks from outside the driver."""
    attributes = pv["spec"]["csi"]["volumeAttributes"]
    return served.box.state_dir / "pool" / f"{pv['spec']['csi']['volumeHandle']}.{attributes['format']}"


# ---------------------------------------------------------------------------
# The flows


SEED, BLOCKS = 4242, 8


async def test_vm_pod_boots_from_the_published_socket(
    served: Served[DriverProcess], deploy: Deploy, guest_image: GuestImage, metrics_port: int
) -> None:
    pvc, pod = deploy.example(VM_EXAMPLE)
    sc = deploy.storage_class(pvc["spec"]["storageClassName"])
    assert sc["metadata"]["name"] == "csi-qsd-vm" and sc["parameters"]["export"] == "vhost-user-blk"
    _, provisioner, kubelet = await setup_components(served, deploy)

    pv = await provisioner.provision(pvc, sc)
    volume_id = pv["spec"]["csi"]["volumeHandle"]
    assert pv["metadata"]["name"] == f"pvc-{pvc['metadata']['uid']}"
    assert "fsType" not in pv["spec"]["csi"], "the VM class has no fstype: the volume is a socket directory"
    target = await kubelet.mount(pv, pod)
    await kubelet.stats(pv, target)

    # The QEMU command of the example: its vhost-user-blk device and the chardev it names.
    (qemu,) = pod["spec"]["containers"]
    options = qemu_options(" ".join(qemu.get("command", []) + qemu.get("args", [])))
    (device,) = [properties(v)[1] for v in options["-device"] if properties(v)[0] == "vhost-user-blk-pci"]
    chardevs = {properties(v)[1]["id"]: properties(v) for v in options["-chardev"]}
    backend, chardev = chardevs[device["chardev"]]
    assert backend == "socket"
    mount, volume, relative = resolve_mount(pod["spec"], qemu, chardev["path"])
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    published_socket = target / relative
    assert stat.S_ISSOCK(published_socket.stat().st_mode), f"no socket at {published_socket}"
    fs_group = pod["spec"]["securityContext"]["fsGroup"]
    assert published_socket.stat().st_gid == fs_group, "the pod's fsGroup must be able to open the socket"
    # QEMU opens it through the pod's mount (container_view): the host path is too long for a socket.

    config_wce = {"on": True, "off": False}.get(device.get("config-wce", ""))
    with container_view(served.box.root / "qemu-container", mount["mountPath"], target) as rootfs:
        disk = VhostUserDisk(
            rootfs / chardev["path"].lstrip("/"),
            num_queues=int(device.get("num-queues", "1")),
            config_wce=config_wce,
            reconnect_s=int(chardev.get("reconnect", "0")),
        )
        assert disk.num_queues <= int(sc["parameters"]["numQueues"])
        script = guest_script(
            write_pattern("/dev/vda", SEED, BLOCKS),
            verify_pattern("/dev/vda", SEED, BLOCKS),
            count_kernel_io_errors(),
        )
        offsets: list[float | None] = []
        vm = await start_vm(guest_image, [disk], script, timeout=VM_TIMEOUT_S)
        async with vm:
            finished = asyncio.ensure_future(vm.wait())
            try:
                while not finished.done():  # scrape /metrics during the guest's I/O
                    offsets.append(await metric(metrics_port, "csi_qsd_volume_write_highest_offset_bytes",
                                                volume_id=volume_id))
                    await asyncio.wait({finished}, timeout=0.5)
            finally:
                result = await finished
    assert result.exit_code == 0, result.output
    (summary,) = verify_summaries(result.output)
    assert (summary.ok, summary.mismatch, summary.ioerrors) == (BLOCKS, 0, 0), result.output
    assert "KERNEL_IO_ERRORS 0" in result.lines
    assert offsets, "/metrics was not scraped while the guest ran"
    highest = await metric(metrics_port, "csi_qsd_volume_write_highest_offset_bytes", volume_id=volume_id)
    assert highest is not None and highest >= BLOCKS * MIB

    # The pod is gone: kubelet tears the volume down, then the claim is deleted.
    await kubelet.unmount(pv, pod)
    image = image_of(served, pv)
    raw = served.box.root / "check.raw"
    await run("qemu-img", "dd", "-f", pv["spec"]["csi"]["volumeAttributes"]["format"], "-O", "raw",
              "bs=1M", f"count={BLOCKS}", f"if={image}", f"of={raw}")
    data = raw.read_bytes()
    for index in range(BLOCKS):
        assert data[index * MIB:(index + 1) * MIB] == pattern_block(SEED, index), f"block {index} not in the image"
    await provisioner.delete(pv)
    await until(lambda: not image.exists(), "the deleted volume's image to go", 10)
    listed = await served.csi.controller.ListVolumes(pb.ListVolumesRequest())
    assert volume_id not in {entry.volume.volume_id for entry in listed.entries}


async def test_filesystem_pod_writes_into_the_published_mount(served: Served[DriverProcess], deploy: Deploy) -> None:
    pvc, pod = deploy.example(FS_EXAMPLE)
    sc = deploy.storage_class(pvc["spec"]["storageClassName"])
    assert sc["metadata"]["name"] == "csi-qsd-fs"
    _, provisioner, kubelet = await setup_components(served, deploy)

    pv = await provisioner.provision(pvc, sc)
    assert pv["spec"]["csi"]["fsType"] == sc["parameters"][FSTYPE_KEY]
    target = await kubelet.mount(pv, pod)
    fstype = (await run("findmnt", "-n", "-o", "FSTYPE", "--mountpoint", str(target))).strip()
    assert fstype == pv["spec"]["csi"]["fsType"]

    # The example's container command (without its final sleep), as the pod's user and groups.
    app = container(pod["spec"], "app")
    assert app["command"] == ["/bin/sh", "-c"]
    (mount,) = app["volumeMounts"]
    context = pod["spec"]["securityContext"]
    steps = [step for step in app["args"][0].split(" && ") if not step.startswith("exec ")]
    steps += [f"mkdir {mount['mountPath']}/dir",
              f"dd if=/dev/urandom of={mount['mountPath']}/dir/blob bs=1M count=4 conv=fsync 2>/dev/null"]
    os.chmod(served.box.root, 0o711)  # let the pod's user reach its container root below
    with container_view(served.box.root / "app-container", mount["mountPath"], target) as rootfs:
        script = re.sub(rf"(?<![\w/]){re.escape(mount['mountPath'])}(?=/|\s|$)",
                        str(rootfs / mount["mountPath"].lstrip("/")), " && ".join(steps))
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", script, user=context["runAsUser"], group=context["runAsGroup"],
            extra_groups=[context["fsGroup"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0, f"the pod's command failed as uid {context['runAsUser']}: {out.decode()}"
    hello = target / "hello.txt"
    assert hello.stat().st_uid == context["runAsUser"]
    hello_text = hello.read_text()
    assert len(hello_text.splitlines()) == 1
    blob = (target / "dir" / "blob").read_bytes()
    assert len(blob) == 4 * MIB
    stats = await kubelet.stats(pv, target)
    (usage,) = [u for u in stats.usage if u.unit == pb.VolumeUsage.BYTES]
    assert usage.used >= 4 * MIB and usage.total > requested_bytes(pvc) // 2

    await kubelet.unmount(pv, pod)
    # The next pod of the claim (another pod UID) sees what the first one wrote.
    second = copy.deepcopy(pod)
    second["metadata"]["uid"] = str(uuid.uuid4())
    target = await kubelet.mount(pv, second)
    assert (target / "hello.txt").read_text() == hello_text
    assert (target / "dir" / "blob").read_bytes() == blob
    await kubelet.unmount(pv, second)
    await provisioner.delete(pv)
    await until(lambda: not image_of(served, pv).exists(), "the deleted volume's image to go", 10)


CLASS_NAMES = sorted(sc["metadata"]["name"] for sc in select(render(DEPLOY_DIR), "StorageClass"))


@pytest.mark.parametrize("class_name", CLASS_NAMES)
async def test_storage_class_parameters_are_accepted_by_the_driver(
    served: Served[DriverProcess], deploy: Deploy, class_name: str
) -> None:
    """Every class's parameters create a volume on a real driver, as the provisioner sends them and verbatim."""
    sc = deploy.storage_class(class_name)
    pvc = copy.deepcopy(next(p for p in select(deploy.examples, "PersistentVolumeClaim")
                             if p["spec"]["storageClassName"] == class_name and "dataSource" not in p["spec"]))
    pvc["metadata"].update(namespace="default", uid=str(uuid.uuid4()))
    pvc["spec"]["resources"]["requests"]["storage"] = "64Mi"
    _, provisioner, _ = await setup_components(served, deploy)
    assert await provisioner.capacity(sc) > 0, "GetCapacity with the class's parameters must count this pool"

    request, _ = provisioner.create_request(pvc, sc)
    volume = (await served.csi.controller.CreateVolume(request)).volume
    verbatim = pb.CreateVolumeRequest()
    verbatim.CopyFrom(request)
    verbatim.name = request.name + "-verbatim"
    verbatim.parameters.clear()
    verbatim.parameters.update(sc.get("parameters") or {})
    other = (await served.csi.controller.CreateVolume(verbatim)).volume
    for created in (volume, other):
        await served.csi.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=created.volume_id))

    # The check notices a parameter the driver does not know.
    typo = pb.CreateVolumeRequest()
    typo.CopyFrom(request)
    typo.name = request.name + "-typo"
    typo.parameters["noSuchParameter"] = "1"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await served.csi.controller.CreateVolume(typo)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "noSuchParameter" in (refused.value.details() or "")
