"""A one-node Kubernetes cluster, started and torn down by the test suite.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd
and kubelet run inside one node namespace (`namespace.NodeNamespace`). The
API server listens on the node's address, which the host reaches over the
node's veth link, so tests drive the cluster from the host with kubectl and
the Kubernetes client. Pods get addresses on a CNI bridge inside the node;
the `kubernetes` Service's address is forwarded to the API server by one
DNAT rule in the node's own netfilter tables (what kube-proxy would do for
that one Service), so in-cluster clients such as the CSI sidecars work.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster import namespace
from e2e.cluster.pki import CertPair, ClusterPKI
from e2e.cluster.versions import KUBERNETES, PAUSE_IMAGE

SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"
POD_CIDR = "10.244.0.0/24"


@dataclass(frozen=True)
class Binaries:
    """Where the cluster's programs are."""

    kubernetes: Path  # kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl, etcd

    def __getitem__(self, name: str) -> str:
        return str(self.kubernetes / name)


def _kubeconfig(path: Path, server: str, ca: Path, pair: CertPair) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "default",
        "clusters": [{"name": "default", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "default", "user": {"client-certificate": str(pair.cert), "client-key": str(pair.key)}}],
        "contexts": [{"name": "default", "context": {"cluster": "default", "user": "default"}}],
    }
    path.write_text(json.dumps(config, indent=1))
    return path


class Cluster:
    """One node, named `node_name`, with its control plane; state and logs under `base`."""

    def __init__(self, base: Path, binaries: Binaries, *, node_name: str = "csi-qsd-node-a",
                 host_if: str = "csiq-a", subnet: str = "10.250.0") -> None:
        self.base = base
        self.bin = binaries
        self.node_name = node_name
        self.address = namespace.NodeAddress(host_if, f"{subnet}.1", f"{subnet}.2")
        self.node = namespace.NodeNamespace(node_name, base / "node", self.address)
        self.logs = base / "logs"
        self.server = f"https://{self.address.node_ip}:6443"
        self.pki: ClusterPKI | None = None
        self.admin_kubeconfig = base / "admin.kubeconfig"
        self.containerd_socket = base / "containerd" / "containerd.sock"

    # -- start ------------------------------------------------------------------------------

    def start(self, images: list[Path]) -> None:
        """Start everything, import `images` (archives) into containerd, and wait for the node to be Ready."""
        self.logs.mkdir(parents=True, exist_ok=True)
        pki = self.pki = ClusterPKI(self.base / "pki")
        ip = self.address.node_ip
        admin = pki.issue("admin", "kubernetes-admin", org="system:masters")
        _kubeconfig(self.admin_kubeconfig, self.server, pki.ca, admin)
        self.node.start()
        self._start_etcd()
        self._start_apiserver(pki, ip)
        self._wait_ready()
        for component in ("kube-controller-manager", "kube-scheduler"):
            pair = pki.issue(component, f"system:{component}")
            kubeconfig = _kubeconfig(self.base / f"{component}.kubeconfig", self.server, pki.ca, pair)
            args = [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--v=1"]
            if component == "kube-controller-manager":
                args += [f"--service-account-private-key-file={pki.service_account_key}",
                         f"--root-ca-file={pki.ca}", f"--cluster-signing-cert-file={pki.ca}",
                         f"--cluster-signing-key-file={pki.ca_key}", "--use-service-account-credentials=true",
                         f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
                         "--controllers=*,-nodeipam,-service-lb-controller,-cloud-node-lifecycle",
                         "--concurrent-gc-syncs=2"]
            else:
                args += [f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}"]
            self.node.spawn(component, [self.bin[component], *args], self.logs / f"{component}.log")
        self._start_containerd(images)
        self._start_kubelet(pki, ip)
        self.wait_node_ready()
        self._wait_default_service_account()

    def _wait_default_service_account(self, timeout: float = 60) -> None:
        # Pods are refused until the controller-manager has made the namespace's service account.
        namespace.wait_for(lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                           timeout, "the default service account")

    def _start_etcd(self) -> None:
        data = self.base / "etcd"
        self.node.spawn("etcd", [
            self.bin["etcd"], f"--data-dir={data}", "--name=default",
            "--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=default=http://127.0.0.1:2380",
            # A test cluster's state need not survive a power loss; fsync would make every write wait on the disk.
            "--unsafe-no-fsync", "--log-level=warn",
        ], self.logs / "etcd.log")

    def _start_apiserver(self, pki: ClusterPKI, ip: str) -> None:
        serving = pki.issue("apiserver", "kube-apiserver", server=True, client=False, hosts=(
            ip, SERVICE_IP, "127.0.0.1", "localhost", "kubernetes", "kubernetes.default",
            "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"))
        kubelet_client = pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", org="system:masters")
        self.node.spawn("kube-apiserver", [
            self.bin["kube-apiserver"], "--etcd-servers=http://127.0.0.1:2379",
            f"--advertise-address={ip}", "--bind-address=0.0.0.0", "--secure-port=6443",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--client-ca-file={pki.ca}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--kubelet-client-certificate={kubelet_client.cert}", f"--kubelet-client-key={kubelet_client.key}",
            f"--kubelet-certificate-authority={pki.ca}",
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--enable-admission-plugins=NodeRestriction", "--profiling=false", "--v=1",
        ], self.logs / "kube-apiserver.log")

    def _ssl_context(self) -> ssl.SSLContext:
        assert self.pki is not None
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.directory / "admin.crt"), str(self.pki.directory / "admin.key"))
        return context

    def _wait_ready(self, timeout: float = 90) -> None:
        context = self._ssl_context()
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self.node.check_alive()
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=context, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError as error:
                last = str(error)
            time.sleep(0.3)
        raise TimeoutError(f"kube-apiserver not ready after {timeout:.0f}s: {last} (see {self.logs})")

    def _start_containerd(self, images: list[Path]) -> None:
        root = self.base / "containerd"
        cni = self.base / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "csi-qsd-cluster",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
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
        self.node.spawn("containerd", ["containerd", "--config", str(config)], self.logs / "containerd.log")
        namespace.wait_for(self.containerd_socket.exists, 30, "containerd's socket")
        for archive in images:
            self.ctr("images", "import", str(archive))
        # The `kubernetes` Service, as kube-proxy would forward it, for pods and host-network pods alike.
        for chain in ("PREROUTING", "OUTPUT"):
            self.node.run(["iptables", "-w", "-t", "nat", "-A", chain, "-d", SERVICE_IP, "-p", "tcp",
                           "--dport", "443", "-j", "DNAT", "--to-destination", f"{self.address.node_ip}:6443"])

    def ctr(self, *args: str) -> str:
        """`ctr` against the node's containerd, in its `k8s.io` namespace."""
        return self.node.run(["ctr", "-a", str(self.containerd_socket), "-n", "k8s.io", *args], timeout=600).stdout

    def _start_kubelet(self, pki: ClusterPKI, ip: str) -> None:
        name = self.node_name
        client = pki.issue("kubelet", f"system:node:{name}", org="system:nodes")
        serving = pki.issue("kubelet-serving", f"system:node:{name}", org="system:nodes", server=True,
                            client=False, hosts=(ip, name))
        kubeconfig = _kubeconfig(self.base / "kubelet.kubeconfig", self.server, pki.ca, client)
        manifests = self.base / "manifests"
        manifests.mkdir(exist_ok=True)
        config = self.base / "kubelet.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.node.cgroup, "cgroupsPerQOS": True,
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
        self.node.spawn("kubelet", [
            self.bin["kubelet"], f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={name}", f"--node-ip={ip}", "--v=2",
        ], self.logs / "kubelet.log")

    def wait_node_ready(self, timeout: float = 120) -> None:
        """Wait until the node reports Ready."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self.node.check_alive()
            result = self.kubectl("get", "node", self.node_name, "-o", "json", check=False)
            if result.returncode == 0:
                conditions = json.loads(result.stdout)["status"].get("conditions", [])
                ready = [c for c in conditions if c["type"] == "Ready"]
                if ready and ready[0]["status"] == "True":
                    return
                last = json.dumps(ready)
            else:
                last = result.stderr.strip()
            time.sleep(1)
        raise TimeoutError(f"node {self.node_name} not Ready after {timeout:.0f}s: {last} (see {self.logs})")

    # -- use --------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """kubectl as the cluster's admin, from the host."""
        result = subprocess.run([self.bin["kubectl"], f"--kubeconfig={self.admin_kubeconfig}", *args],
                                capture_output=True, text=True, input=input, timeout=timeout,
                                env={**os.environ, "LC_ALL": "C"})
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    @property
    def version(self) -> str:
        return KUBERNETES

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stop everything in the node; return what could not be cleaned up."""
        return self.node.stop()
