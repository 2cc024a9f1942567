"""A worker node: containerd and kubelet in a node namespace of their own, joined to the cluster's API server.

Each node has its own mount, PID, network and UTS namespaces, its own
/var/lib/kubelet and /var/lib/csi-qsd, containerd state and cgroup root,
and a pod subnet of its own on a CNI bridge. Nodes reach each other and the
host over the host's bridge; each routes the other nodes' pod subnets to
them, and forwards the `kubernetes` Service's address to the API server
with one DNAT rule (what kube-proxy would do for that one Service).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from csi_qsd.sys import loop_ioctl
from testing.cluster import namespace
from testing.cluster.pki import CertPair, ClusterPKI
from testing.cluster.versions import PAUSE_IMAGE

SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"


def kubeconfig(path: Path, server: str, ca: Path, pair: CertPair) -> Path:
    """A kubeconfig for `server` with the client certificate `pair`."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "default",
        "clusters": [{"name": "default", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "default", "user": {"client-certificate": str(pair.cert), "client-key": str(pair.key)}}],
        "contexts": [{"name": "default", "context": {"cluster": "default", "user": "default"}}],
    }
    path.write_text(json.dumps(config, indent=1))
    return path


@dataclass(frozen=True)
class NodeSpec:
    """Where a node is: its name, its link and its pod subnet."""

    name: str
    address: namespace.NodeAddress
    pod_cidr: str


class KubeletNode:
    """One node's containerd and kubelet; state under `base`, logs in `logs`."""

    def __init__(self, spec: NodeSpec, base: Path, logs: Path, kubelet_binary: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.base = base
        self.kubelet_binary = kubelet_binary
        self.namespace = namespace.NodeNamespace(spec.name, base / "node", spec.address)
        self.logs = logs
        self.containerd_socket = base / "containerd" / "containerd.sock"

    @property
    def ip(self) -> str:
        return self.spec.address.node_ip

    def start_namespace(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.namespace.start()

    def start(self, images: list[Path], pki: ClusterPKI, server: str, api_server_ip: str) -> None:
        """containerd with `images` imported, the Service forward, then kubelet (registering itself)."""
        self._start_containerd(images)
        # The `kubernetes` Service, as kube-proxy would forward it, for pods and host-network pods alike.
        for chain in ("PREROUTING", "OUTPUT"):
            self.namespace.run(["iptables", "-w", "-t", "nat", "-A", chain, "-d", SERVICE_IP, "-p", "tcp",
                                "--dport", "443", "-j", "DNAT", "--to-destination", f"{api_server_ip}:6443"])
        self._start_kubelet(pki, server)

    def route_pods_of(self, other: KubeletNode) -> None:
        """Send traffic for `other`'s pods to `other`."""
        self.namespace.run(["ip", "route", "replace", other.spec.pod_cidr, "via", other.ip])

    def _start_containerd(self, images: list[Path]) -> None:
        root = self.base / "containerd"
        cni = self.base / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "csi-qsd-cluster",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.spec.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "/run/cni-ipam"}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}))
        root.mkdir(parents=True, exist_ok=True)
        config = root / "config.toml"
        config.write_text(f"""version = 2
root = "{root / 'root'}"
state = "{root / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{self.containerd_socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Lowering a process's oom_score_adj needs CAP_SYS_RESOURCE, which some hosts withhold:
  # kubelet asks -998 for every pod sandbox, and runc would fail to start it.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni / 'net.d'}"
""")
        self.namespace.spawn("containerd", ["containerd", "--config", str(config)], self.logs / "containerd.log")
        namespace.wait_for(self.containerd_socket.exists, 30, f"{self.name}'s containerd socket")
        for archive in images:
            self.ctr("images", "import", str(archive))

    def ctr(self, *args: str) -> str:
        """`ctr` against the node's containerd, in its `k8s.io` namespace."""
        return self.namespace.run(["ctr", "-a", str(self.containerd_socket), "-n", "k8s.io", *args],
                                  timeout=600).stdout

    def _start_kubelet(self, pki: ClusterPKI, server: str) -> None:
        name = self.name
        client = pki.issue(f"kubelet-{name}", f"system:node:{name}", org="system:nodes")
        serving = pki.issue(f"kubelet-serving-{name}", f"system:node:{name}", org="system:nodes", server=True,
                            client=False, hosts=(self.ip, name))
        config_file = kubeconfig(self.base / "kubelet.kubeconfig", server, pki.ca, client)
        manifests = self.base / "manifests"
        manifests.mkdir(exist_ok=True)
        config = self.base / "kubelet.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.namespace.cgroup, "cgroupsPerQOS": True,
            "failSwapOn": False, "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "staticPodPath": str(manifests), "tlsCertFile": str(serving.cert), "tlsPrivateKeyFile": str(serving.key),
            "clusterDomain": "cluster.local", "resolvConf": "/etc/resolv.conf",
            # Images cannot be pulled again here: never collect them, evict only when really short.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
            "rotateCertificates": False, "maxPods": 60, "registerNode": True,
            "syncFrequency": "10s", "fileCheckFrequency": "5s", "nodeStatusUpdateFrequency": "5s",
            "shutdownGracePeriod": "0s",
        }))
        self.namespace.spawn("kubelet", [
            self.kubelet_binary, f"--config={config}", f"--kubeconfig={config_file}",
            f"--hostname-override={name}", f"--node-ip={self.ip}", "--v=2",
        ], self.logs / "kubelet.log")

    def loop_devices(self) -> list[Path]:
        """Loop devices over the node's FUSE exports, found by the exports' device numbers.

        Not by sysfs' path: a loop device attached from a container whose namespace is gone reads "/".
        """
        exports: set[tuple[int, int]] = set()
        for line in Path(f"/proc/{self.namespace.pid}/mountinfo").read_text().splitlines():
            fields = line.split()
            fs_type = fields[fields.index("-") + 1]
            if fields[4].startswith("/var/lib/csi-qsd/") and fs_type.startswith("fuse"):
                major, minor = fields[2].split(":")
                exports.add((int(major), int(minor)))
        found = []
        for attribute in Path("/sys/block").glob("loop*/loop/backing_file"):
            device = Path("/dev") / attribute.parent.parent.name
            identity = loop_ioctl.backing_identity(device)
            if identity is not None and identity[:2] in exports:
                found.append(device)
        return found

    def stop(self) -> list[str]:
        """Stop everything in the node; return what could not be cleaned up.

        Loop devices over its FUSE exports (a volume still staged when the node stops) are detached after:
        they belong to the host, and would outlive the node.
        """
        try:
            loops = self.loop_devices()
        except (OSError, AssertionError):
            loops = []
        problems = self.namespace.stop()
        for device in loops:
            loop_ioctl.detach(device)
        return problems
