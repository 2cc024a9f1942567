"""A Kubernetes cluster started and torn down by the test suite: one node, and more on demand.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run in the
first node's namespace beside its containerd and kubelet (`node.KubeletNode`);
`add_node` starts another node (its own namespaces, containerd and kubelet)
that joins the same API server. The API server listens on the first node's
address, which the host reaches over the host's bridge, so tests drive the
cluster from the host with kubectl.
"""

from __future__ import annotations

import fcntl
import json
import os
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from testing.cluster import namespace
from testing.cluster.kubelet_node import SERVICE_CIDR, SERVICE_IP, KubeletNode, NodeSpec, kubeconfig
from testing.cluster.pki import ClusterPKI
from testing.cluster.versions import KUBERNETES

BRIDGE = "csiq-br"
# One cluster of this project on a machine at a time, whichever checkout or user runs it.
MACHINE_LOCK = Path("/run/lock/csi-qsd-cluster.lock")
SUBNET = "10.250.0"


@dataclass(frozen=True)
class Binaries:
    """Where the cluster's programs are."""

    kubernetes: Path  # kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl, etcd

    def __getitem__(self, name: str) -> str:
        return str(self.kubernetes / name)


def node_spec(index: int) -> NodeSpec:
    """Node `index` (0: the control plane's): its name, link, address and pod subnet."""
    letter = "abcdefgh"[index]
    return NodeSpec(f"csi-qsd-node-{letter}",
                    namespace.NodeAddress(f"csiq-{letter}", BRIDGE, f"{SUBNET}.1", f"{SUBNET}.{index + 2}"),
                    f"10.244.{index}.0/24")


class Cluster:
    """The control plane on the first node, `node_name`; state and logs under `base`."""

    def __init__(self, base: Path, binaries: Binaries) -> None:
        self.base = base
        self.bin = binaries
        self.logs = base / "logs"
        self.first = KubeletNode(node_spec(0), base, self.logs, self.bin["kubelet"])
        self.nodes: list[KubeletNode] = [self.first]
        self.node_name = self.first.name
        self.node = self.first.namespace
        self.address = self.first.spec.address
        self.server = f"https://{self.first.ip}:6443"
        self.pki: ClusterPKI | None = None
        self.admin_kubeconfig = base / "admin.kubeconfig"
        self.containerd_socket = self.first.containerd_socket
        self._machine_lock: IO[str] | None = None

    # -- start ------------------------------------------------------------------------------

    def start(self, images: list[Path]) -> None:
        """Start everything, import `images` (archives) into containerd, and wait for the node to be Ready."""
        self._take_the_machine()
        self.logs.mkdir(parents=True, exist_ok=True)
        pki = self.pki = ClusterPKI(self.base / "pki")
        ip = self.first.ip
        admin = pki.issue("admin", "kubernetes-admin", org="system:masters")
        kubeconfig(self.admin_kubeconfig, self.server, pki.ca, admin)
        namespace.add_bridge(self.address)
        self.first.start_namespace()
        self._start_etcd()
        self._start_apiserver(pki, ip)
        self._wait_ready()
        for component in ("kube-controller-manager", "kube-scheduler"):
            pair = pki.issue(component, f"system:{component}")
            config = kubeconfig(self.base / f"{component}.kubeconfig", self.server, pki.ca, pair)
            args = [f"--kubeconfig={config}", "--leader-elect=false", "--v=1"]
            if component == "kube-controller-manager":
                args += [f"--service-account-private-key-file={pki.service_account_key}",
                         f"--root-ca-file={pki.ca}", f"--cluster-signing-cert-file={pki.ca}",
                         f"--cluster-signing-key-file={pki.ca_key}", "--use-service-account-credentials=true",
                         f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
                         "--controllers=*,-nodeipam,-service-lb-controller,-cloud-node-lifecycle",
                         "--concurrent-gc-syncs=2"]
            else:
                args += [f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}"]
            self.node.spawn(component, [self.bin[component], *args], self.logs / f"{component}.log")
        self.first.start(images, pki, self.server, ip)
        self.wait_node_ready()
        self._wait_default_service_account()

    def add_node(self, images: list[Path]) -> KubeletNode:
        """Start the next node, joined to this cluster, its pods routed both ways; wait until it is Ready."""
        assert self.pki is not None, "the cluster is not started"
        index = len(self.nodes)
        added = KubeletNode(node_spec(index), self.base / f"node-{index}", self.logs / node_spec(index).name,
                            self.bin["kubelet"])
        self.nodes.append(added)
        added.start_namespace()
        added.start(images, self.pki, self.server, self.first.ip)
        for other in self.nodes[:-1]:
            added.route_pods_of(other)
            other.route_pods_of(added)
        self.wait_node_ready(added.name)
        return added

    def remove_node(self, node: KubeletNode) -> list[str]:
        """Delete `node` from the cluster and stop it; return what could not be cleaned up."""
        self.kubectl("delete", "node", node.name, "--wait=true", "--timeout=60s", check=False)
        problems = node.stop()
        self.nodes.remove(node)
        for other in self.nodes:
            other.namespace.run(["ip", "route", "del", node.spec.pod_cidr], check=False)
        return problems

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

    def ctr(self, *args: str) -> str:
        """`ctr` against the first node's containerd, in its `k8s.io` namespace."""
        return self.first.ctr(*args)

    def wait_node_ready(self, name: str = "", timeout: float = 120) -> None:
        """Wait until the node `name` (default: the first) reports Ready."""
        name = name or self.node_name
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for node in self.nodes:
                node.namespace.check_alive()
            result = self.kubectl("get", "node", name, "-o", "json", check=False)
            if result.returncode == 0:
                conditions = json.loads(result.stdout)["status"].get("conditions", [])
                ready = [c for c in conditions if c["type"] == "Ready"]
                if ready and ready[0]["status"] == "True":
                    return
                last = json.dumps(ready)
            else:
                last = result.stderr.strip()
            time.sleep(1)
        raise TimeoutError(f"node {name} not Ready after {timeout:.0f}s: {last} (see {self.logs})")

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
        """Stop every node (the control plane's last) and remove the bridge; return what could not be cleaned up."""
        problems: list[str] = []
        for node in reversed(self.nodes):
            problems += node.stop()
        namespace.remove_bridge(self.address)
        if self._machine_lock is not None:
            self._machine_lock.close()  # and with it the lock
            self._machine_lock = None
        return problems

    def _take_the_machine(self) -> None:
        """Wait until no other cluster of this project runs here: they would share the bridge, the node's
        addresses and ports."""
        self._machine_lock = open(MACHINE_LOCK, "w")  # noqa: SIM115 (held until stop)
        try:
            fcntl.flock(self._machine_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"cluster: another cluster runs on this machine; waiting for it ({MACHINE_LOCK})", flush=True)
            fcntl.flock(self._machine_lock, fcntl.LOCK_EX)
