"""Which versions the cluster tier builds and runs: the one place to change them.

Kubernetes 1.34 is the newest line that runs on a cgroup v1 host with
containerd 1.6 without opting out of anything (1.35 kubelets refuse cgroup
v1 unless `failCgroupV1: false`, and 1.35 is the last line for containerd
1.x). etcd is built at the version kube-apiserver's own module requires.
The sidecars are the releases deploy/node.yaml names.
"""

from __future__ import annotations

from dataclasses import dataclass

KUBERNETES = "v1.34.4"
KUBERNETES_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "etcd",
                       "e2e.test", "agnhost", "ginkgo")

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# Debian's busybox-static under the name deploy/examples/ use, so the examples run unchanged.
BUSYBOX_IMAGE = "docker.io/library/busybox:1.36"
# busybox and this cluster's kubectl, under the name deploy/examples/hotplug.yaml's node agent uses.
KUBECTL_IMAGE = "docker.io/bitnami/kubectl:1.34"
# The images the e2e suite's storage tests start (k8s.io/kubernetes test/utils/image at KUBERNETES): its
# busybox and nginx (only ever given shell commands) and agnhost (the host-exec pods: agnhost and nsenter),
# from busybox-static; jessie-dnsutils (GNU dd for multiVolume) from a Debian base.
E2E_BUSYBOX_IMAGE = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
E2E_AGNHOST_IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.56"
E2E_NGINX_IMAGE = "registry.k8s.io/e2e-test-images/nginx:1.14-4"
E2E_JESSIE_IMAGE = "registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7"
E2E_PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"


@dataclass(frozen=True)
class Sidecar:
    """A CSI sidecar built from its Go module: the image deploy/ names and the main package."""

    image: str
    module: str
    version: str
    package: str


SIDECARS = (
    Sidecar("registry.k8s.io/sig-storage/csi-provisioner:v6.4.0",
            "github.com/kubernetes-csi/external-provisioner/v6", "v6.4.0", "cmd/csi-provisioner"),
    Sidecar("registry.k8s.io/sig-storage/csi-snapshotter:v8.7.0",
            "github.com/kubernetes-csi/external-snapshotter/v8", "v8.7.0", "cmd/csi-snapshotter"),
    Sidecar("registry.k8s.io/sig-storage/snapshot-controller:v8.7.0",
            "github.com/kubernetes-csi/external-snapshotter/v8", "v8.7.0", "cmd/snapshot-controller"),
    Sidecar("registry.k8s.io/sig-storage/csi-resizer:v2.3.0",
            "github.com/kubernetes-csi/external-resizer/v2", "v2.3.0", "cmd/csi-resizer"),
)

# The snapshot CRDs ship in the snapshotter's client module (config/crd/), the controller's
# manifests in the snapshotter's own (deploy/kubernetes/snapshot-controller/).
SNAPSHOT_CLIENT_MODULE = ("github.com/kubernetes-csi/external-snapshotter/client/v8", "v8.7.0")
SNAPSHOTTER_MODULE = ("github.com/kubernetes-csi/external-snapshotter/v8", "v8.7.0")

# Helm, for the chart in charts/csi-qsd (built from its module like the rest; it keeps its version in a package
# of its own, set at link time as its Makefile does).
HELM_MODULE = "helm.sh/helm/v3"
HELM = "v3.22.0"
HELM_LDFLAGS = f"-X {HELM_MODULE}/internal/version.version={HELM}"
