"""The node DaemonSet: socket and mount layout, sidecar modes, and what keeps
qemu-storage-daemon running while the plugin restarts."""

from __future__ import annotations

import posixpath
import re

import pytest

from testing.manifests.objects import (
    DRIVER_NAME,
    VAR_REF,
    Obj,
    container,
    env_names,
    field_ref,
    flag_value,
    flag_values,
    has_switch,
    host_path_of,
    one,
    resolve_mount,
    unix_path,
)

SIDECARS = ("node-driver-registrar", "csi-provisioner", "csi-snapshotter", "csi-resizer", "liveness-probe")
SIDECAR_IMAGES = {
    "node-driver-registrar": "registry.k8s.io/sig-storage/csi-node-driver-registrar",
    "csi-provisioner": "registry.k8s.io/sig-storage/csi-provisioner",
    "csi-snapshotter": "registry.k8s.io/sig-storage/csi-snapshotter",
    "csi-resizer": "registry.k8s.io/sig-storage/csi-resizer",
    "liveness-probe": "registry.k8s.io/sig-storage/livenessprobe",
}


@pytest.fixture
def daemonset(base: list[Obj]) -> Obj:
    return one(base, "DaemonSet", "csi-qsd-node")


@pytest.fixture
def pod(daemonset: Obj) -> Obj:
    spec: Obj = daemonset["spec"]["template"]["spec"]
    return spec


@pytest.fixture
def plugin(pod: Obj) -> Obj:
    return container(pod, "csi-qsd")


@pytest.fixture
def qsd(pod: Obj) -> Obj:
    return container(pod, "qsd")


def plugin_socket_host_path(pod: Obj, plugin: Obj) -> str:
    endpoint = flag_value(plugin["args"], "--endpoint")
    return host_path_of(pod, plugin, unix_path(endpoint))


def test_containers(pod: Obj) -> None:
    names = [c["name"] for c in pod["containers"]]
    assert sorted(names) == sorted(["csi-qsd", "qsd", *SIDECARS])
    assert not pod.get("initContainers")


def test_plugin_command(plugin: Obj) -> None:
    args = plugin["args"]
    assert args[0] == "serve"
    assert flag_value(args, "--qsd-mode") == "external"
    assert flag_value(args, "--driver-name") == DRIVER_NAME
    assert plugin.get("securityContext", {}).get("privileged") is True
    # The node id is the Kubernetes node name (topology.csi-qsd.io/node).
    assert field_ref(plugin, "CSI_QSD_NODE_ID") == "spec.nodeName"
    assert not flag_values(args, "--node-id")


def test_qsd_container(pod: Obj, plugin: Obj, qsd: Obj) -> None:
    assert qsd["args"][0] == "qsd-run"
    assert qsd["image"] == plugin["image"]
    assert qsd.get("securityContext", {}).get("privileged") is True, "qsd needs /dev/fuse and mounts"
    # A failing probe would restart QSD and pull every volume from its consumers.
    assert "livenessProbe" not in qsd
    assert "/dev" in {m["mountPath"] for m in qsd["volumeMounts"]}


def test_qsd_survives_plugin_restarts(daemonset: Obj, pod: Obj) -> None:
    # Containers restart independently; only deleting the pod stops QSD. A
    # DaemonSet rollout deletes pods, so rollouts are manual (OnDelete).
    assert daemonset["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert pod.get("restartPolicy", "Always") == "Always"
    # The watchdog kills a wedged QSD by the pid in the shared pidfile: one PID namespace for the pod.
    assert pod.get("shareProcessNamespace") is True


def test_state_dir_is_shared(pod: Obj, plugin: Obj, qsd: Obj) -> None:
    plugin_state = flag_value(plugin["args"], "--state-dir")
    qsd_state = flag_value(qsd["args"], "--state-dir")
    assert plugin_state == qsd_state == "/var/lib/csi-qsd"
    for spec in (plugin, qsd):
        mount, volume, relative = resolve_mount(pod, spec, plugin_state)
        assert relative == "."
        assert volume["hostPath"]["path"] == mount["mountPath"] == plugin_state
        # FUSE exports mounted by QSD must reach the plugin and the host.
        assert mount.get("mountPropagation") == "Bidirectional"
    # Both containers must agree on the pool (default: <state-dir>/pool).
    pools = [flag_values(spec["args"], "--pool-dir") for spec in (plugin, qsd)]
    assert pools[0] == pools[1], f"--pool-dir differs between the plugin and qsd: {pools}"
    for pool in pools[0]:
        resolve_mount(pod, qsd, pool)


def test_runtime_dir_is_memory_shared_with_qsd(pod: Obj, plugin: Obj, qsd: Obj) -> None:
    """QEMU's copies of the node's TLS files (a private key) pass through --runtime-dir: it must be tmpfs (an
    emptyDir of medium Memory, never the persistent state hostPath), and QSD, which loads the path QMP names in
    its own container, must see it at the same path."""
    runtime_dir = flag_value(plugin["args"], "--runtime-dir")
    assert runtime_dir and not posixpath.commonpath([runtime_dir, flag_value(plugin["args"], "--state-dir")]) \
        .startswith(runtime_dir.rstrip("/") + "/")
    volumes = []
    for spec in (plugin, qsd):
        mount, volume, relative = resolve_mount(pod, spec, runtime_dir)
        assert relative == "." and mount["mountPath"] == runtime_dir
        assert volume.get("emptyDir", {}).get("medium") == "Memory", volume
        volumes.append(volume["name"])
    assert volumes[0] == volumes[1], f"the plugin and qsd mount different runtime volumes: {volumes}"


def test_kubelet_dir(pod: Obj, plugin: Obj) -> None:
    target_root = flag_value(plugin["args"], "--target-root")
    mount, volume, relative = resolve_mount(pod, plugin, target_root)
    assert relative == "."
    # kubelet passes host paths in staging/target paths: they must resolve
    # to the same place inside the container.
    assert mount["mountPath"] == volume["hostPath"]["path"] == target_root
    assert mount.get("mountPropagation") == "Bidirectional"
    for name in ("socket-dir", "registration-dir"):
        host = next(v for v in pod["volumes"] if v["name"] == name)["hostPath"]["path"]
        assert host.startswith(target_root + "/plugins"), f"{name} must be under {target_root}"


def test_host_devices(pod: Obj, plugin: Obj) -> None:
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    for path in ("/dev", "/sys"):
        _, volume, _ = resolve_mount(pod, plugin, path)
        assert volume["hostPath"]["path"] == path
        assert path in mounts


def test_plugin_socket_is_where_kubelet_looks(pod: Obj, plugin: Obj) -> None:
    host_socket = plugin_socket_host_path(pod, plugin)
    assert host_socket == f"/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock"
    registrar = container(pod, "node-driver-registrar")
    assert flag_value(registrar["args"], "--kubelet-registration-path") == host_socket
    _, volume, _ = resolve_mount(pod, registrar, "/registration")
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"


@pytest.mark.parametrize("name", SIDECARS)
def test_sidecar_reaches_plugin_socket(pod: Obj, plugin: Obj, name: str) -> None:
    sidecar = container(pod, name)
    address = flag_value(sidecar["args"], "--csi-address")
    assert host_path_of(pod, sidecar, address) == plugin_socket_host_path(pod, plugin)


def test_socket_resolution_would_notice_a_mismatch(pod: Obj, plugin: Obj) -> None:
    provisioner = container(pod, "csi-provisioner")
    moved = dict(provisioner, volumeMounts=[{"name": "state-dir", "mountPath": "/csi"}])
    assert host_path_of(pod, moved, "/csi/csi.sock") != plugin_socket_host_path(pod, plugin)


@pytest.mark.parametrize("name", SIDECARS)
def test_sidecar_images_are_pinned(pod: Obj, name: str) -> None:
    image = container(pod, name)["image"]
    repository, _, tag = image.rpartition(":")
    assert repository == SIDECAR_IMAGES[name]
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"{image} is not pinned to a release"


def test_provisioner_is_distributed(pod: Obj) -> None:
    provisioner = container(pod, "csi-provisioner")
    args = provisioner["args"]
    assert has_switch(args, "--node-deployment")
    assert has_switch(args, "--strict-topology")
    assert flag_value(args, "--immediate-topology") == "false"
    assert flag_value(args, "--node-deployment-immediate-binding") == "false"
    assert "Topology=true" in flag_value(args, "--feature-gates").split(",")
    assert has_switch(args, "--enable-capacity")
    # Owner of the CSIStorageCapacity objects: pod -> DaemonSet is one level.
    assert flag_value(args, "--capacity-ownerref-level") == "1"
    assert not has_switch(args, "--leader-election")
    # A burst of claims is not held by client-go's default API rate (5/s, burst 10).
    assert int(flag_value(args, "--kube-api-qps")) >= 20
    assert int(flag_value(args, "--kube-api-burst")) >= 50
    # --default-fstype would give vhost-user-blk volumes a filesystem type.
    assert not flag_values(args, "--default-fstype")
    assert field_ref(provisioner, "NODE_NAME") == "spec.nodeName"
    assert field_ref(provisioner, "NAMESPACE") == "metadata.namespace"
    assert field_ref(provisioner, "POD_NAME") == "metadata.name"


def test_snapshotter_is_distributed(pod: Obj) -> None:
    snapshotter = container(pod, "csi-snapshotter")
    assert has_switch(snapshotter["args"], "--node-deployment")
    assert not has_switch(snapshotter["args"], "--leader-election")
    assert field_ref(snapshotter, "NODE_NAME") == "spec.nodeName"


def test_resizer_has_one_leader(pod: Obj) -> None:
    resizer = container(pod, "csi-resizer")
    args = resizer["args"]
    # One instance per node, one active: see README.md "Volume expansion".
    assert has_switch(args, "--leader-election")
    assert flag_value(args, "--leader-election-namespace") == "$(NAMESPACE)"
    assert field_ref(resizer, "NAMESPACE") == "metadata.namespace"
    probe = resizer["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz/leader-election"


def test_liveness_probe_targets_livenessprobe_sidecar(pod: Obj, plugin: Obj) -> None:
    probe = plugin["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports") or []}
    port = ports[probe["port"]] if isinstance(probe["port"], str) else probe["port"]
    liveness = container(pod, "liveness-probe")
    assert flag_value(liveness["args"], "--http-endpoint") == f":{port}"


def test_env_references_are_defined(pod: Obj) -> None:
    for spec in pod["containers"]:
        for arg in (spec.get("command") or []) + (spec.get("args") or []):
            for name in VAR_REF.findall(arg):
                assert name in env_names(spec), f"{spec['name']}: $({name}) is not in its env"


def test_ports_do_not_collide(pod: Obj) -> None:
    declared: dict[int, str] = {}
    names: set[str] = set()
    for spec in pod["containers"]:
        for port in spec.get("ports") or []:
            assert port["containerPort"] not in declared, f"port {port['containerPort']} declared twice"
            declared[port["containerPort"]] = spec["name"]
            assert port["name"] not in names
            names.add(port["name"])
    listening: dict[int, str] = {}
    for spec in pod["containers"]:
        for flag in ("--http-endpoint", "--metrics-address", "--health-port"):
            for value in flag_values(spec.get("args") or [], flag):
                number = int(value.rsplit(":", 1)[-1])
                assert number not in listening, f"{spec['name']} and {listening[number]} both use {number}"
                listening[number] = spec["name"]
                assert number in declared, f"{spec['name']} listens on undeclared port {number}"
    for spec in pod["containers"]:
        probe = (spec.get("livenessProbe") or {}).get("httpGet")
        if probe and isinstance(probe["port"], str):
            assert probe["port"] in names


def test_volumes_are_hostpaths_that_exist_or_are_created(pod: Obj) -> None:
    used = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts") or []}
    defined = {v["name"] for v in pod["volumes"]}
    assert used == defined
    for volume in pod["volumes"]:
        if "secret" in volume:  # only the optional metadata listener's certificate: the pod starts without it
            assert volume["secret"] == {"secretName": "csi-qsd-node-metadata-tls", "optional": True}
            continue
        if "emptyDir" in volume:  # only --runtime-dir: memory, for files that must never reach a disk
            assert volume == {"name": "runtime-dir", "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}}
            continue
        host = volume["hostPath"]
        assert posixpath.isabs(host["path"])
        assert host["type"] in ("Directory", "DirectoryOrCreate")


def test_mount_propagation_values(pod: Obj) -> None:
    for spec in pod["containers"]:
        for mount in spec.get("volumeMounts") or []:
            propagation = mount.get("mountPropagation")
            assert propagation in (None, "None", "HostToContainer", "Bidirectional")
            if propagation == "Bidirectional":
                assert spec.get("securityContext", {}).get("privileged") is True


def test_pod_runs_everywhere(daemonset: Obj, pod: Obj) -> None:
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "csi-qsd-node"
    assert not pod.get("hostNetwork")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
