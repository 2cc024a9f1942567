"""The Helm chart (charts/csi-qsd, generated from deploy/ by scripts/gen_chart.py) as an operator uses it.

`helm lint`, and `helm template` with the default values rendering the very
objects `kubectl kustomize deploy/` does (with `imagePullPolicy=Never`: the
objects of this cluster's overlay). Then in the session's cluster: the
kustomize deployment is deleted, `helm install` brings the same DaemonSet
Ready and kubelet registers the driver; a pod writes with fsync while
`helm upgrade` sets a new image tag and each node's plugin container takes
it in place (deploy/README.md, "Upgrading": the DaemonSet is OnDelete);
`helm uninstall` leaves no object of the chart. The kustomize deployment is
restored whatever happens, so the tests after this one find the cluster as
the session made it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster.conftest import cluster_marks, report
from testing.cluster import deploy, session, writer
from testing.cluster.build import REPO, UPGRADE_IMAGE, Built, cache_root
from testing.cluster.cluster import Cluster

pytestmark = cluster_marks()

CHART = REPO / "charts" / "csi-qsd"
RELEASE = "csi-qsd"
LOCAL = ("--set", "imagePullPolicy=Never")  # the overlay's one change: every image is imported, none pulled


def _helm(built: Built, cluster: Cluster | None, *args: str, timeout: float = 600) -> str:
    assert built.helm is not None
    argv = [str(built.helm), *args]
    if cluster is not None:
        argv += ["--kubeconfig", str(cluster.admin_kubeconfig)]
    home = cache_root() / "helm-home"  # Helm's cache and config, kept out of the user's
    home.mkdir(exist_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={"LC_ALL": "C", "HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert done.returncode == 0, f"helm {' '.join(args)} exited {done.returncode}: {done.stderr}{done.stdout}"
    return done.stdout


def _objects(text: str) -> dict[tuple[str, str, str], Any]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    found = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}
    assert len(found) == len(docs), "two objects of one kind and name"
    return found


def _kustomize(built: Built, directory: Path) -> dict[tuple[str, str, str], Any]:
    return _objects(subprocess.run([str(built.kubernetes / "kubectl"), "kustomize", str(directory)],
                                   capture_output=True, text=True, check=True).stdout)


def test_helm_lint(built: Built) -> None:
    out = _helm(built, None, "lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out, out


def test_chart_renders_what_kustomize_renders(built: Built) -> None:
    assert _objects(_helm(built, None, "template", RELEASE, str(CHART))) == _kustomize(built, REPO / "deploy")
    assert _objects(_helm(built, None, "template", RELEASE, str(CHART), *LOCAL)) == _kustomize(built, deploy.OVERLAY)


def _live_daemonset(cluster: Cluster) -> dict[str, Any]:
    return deploy.get_json(cluster, "-n", deploy.DRIVER_NAMESPACE, "daemonset", "csi-qsd-node")  # type: ignore[no-any-return]


def _remove_kustomize_deployment(cluster: Cluster) -> None:
    """`kubectl delete -k` of the overlay, once no volume is left for the driver to delete."""
    deploy.wait_until(lambda: not deploy.get_json(cluster, "pv")["items"], 180,
                      "the earlier tests' PersistentVolumes to be deleted")
    cluster.kubectl("delete", "-k", str(deploy.OVERLAY), "--wait=true", "--timeout=180s", timeout=240)


def _chart_objects_left(cluster: Cluster, built: Built) -> list[str]:
    left = []
    for kind, namespace, name in _objects(_helm(built, None, "template", RELEASE, str(CHART), *LOCAL)):
        args = ["get", kind, name, "-o", "name", "--ignore-not-found"] + (["-n", namespace] if namespace else [])
        if cluster.kubectl(*args).stdout.strip():
            left.append(f"{kind} {namespace}/{name}")
    return left


@pytest.fixture
def helm_deployed(cluster: Cluster, built: Built) -> Iterator[dict[str, Any]]:
    """The driver installed by `helm install` instead of `kubectl apply -k`; the kustomize deployment (its
    DaemonSet returned) comes back afterwards."""
    shipped = _live_daemonset(cluster)
    started = time.monotonic()
    _remove_kustomize_deployment(cluster)
    installed = False
    try:
        _helm(built, cluster, "install", RELEASE, str(CHART), *LOCAL)
        installed = True
        deploy.wait_daemonset_ready(cluster)
        deploy.wait_until(lambda: any(d["name"] == "csi-qsd.io" for d in (deploy.get_json(
            cluster, "csinode", cluster.node_name)["spec"].get("drivers") or [])), 120, "kubelet to register csi-qsd.io")
        report(f"helm install: DaemonSet Ready {time.monotonic() - started:.0f} s after `kubectl delete -k` began")
        yield shipped
    finally:
        if installed and _helm_releases(cluster, built):
            _helm(built, cluster, "uninstall", RELEASE, "--wait", "--timeout=5m")
        restored = time.monotonic()
        deploy.deploy_driver(cluster)
        report(f"kustomize deployment restored in {time.monotonic() - restored:.0f} s; "
               f"the Helm test's whole detour: {time.monotonic() - started:.0f} s")


def _helm_releases(cluster: Cluster, built: Built) -> list[str]:
    return [r["name"] for r in json.loads(_helm(built, cluster, "list", "--all", "-o", "json"))]


def test_helm_install_upgrade_uninstall(cluster: Cluster, built: Built, helm_deployed: dict[str, Any],
                                        test_namespace: str) -> None:
    helm_ds = _live_daemonset(cluster)
    assert helm_ds["spec"] == helm_deployed["spec"], "helm install made another DaemonSet than kubectl apply -k"
    assert helm_ds["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "Helm"

    writer.start_writer(cluster, test_namespace)
    qsd_restarts = int(writer.container_status(deploy.driver_pod(cluster), "qsd")["restartCount"])
    deploy.wait_until(lambda: writer.acks(cluster, test_namespace)[0] >= 20, 60, "the writer's first 20 writes")

    tag = UPGRADE_IMAGE.rsplit(":", 1)[1]
    _helm(built, cluster, "upgrade", RELEASE, str(CHART), "--reuse-values", "--set", f"image.tag={tag}")
    images = {c["name"]: c["image"] for c in _live_daemonset(cluster)["spec"]["template"]["spec"]["containers"]}
    assert images["csi-qsd"] == images["qsd"] == UPGRADE_IMAGE, images
    pod = deploy.driver_pod(cluster)
    old_id = writer.container_status(pod, "csi-qsd")["imageID"]
    before = int(writer.container_status(pod, "csi-qsd")["restartCount"])
    cluster.kubectl("-n", deploy.DRIVER_NAMESPACE, "set", "image", f"pod/{pod['metadata']['name']}",
                    f"csi-qsd={UPGRADE_IMAGE}")
    writer.wait_restarted(cluster, "csi-qsd", before)
    upgraded = deploy.driver_pod(cluster)
    assert writer.container_status(upgraded, "csi-qsd")["imageID"] != old_id, "the upgrade ran the same image"
    at_upgrade = writer.acks(cluster, test_namespace)[0]
    deploy.wait_until(lambda: writer.acks(cluster, test_namespace)[0] >= at_upgrade + 20, 60,
                      "20 more acknowledged writes after the upgrade")
    writer.check_writer(cluster, test_namespace)
    assert int(writer.container_status(upgraded, "qsd")["restartCount"]) == qsd_restarts, "QSD restarted"

    # The writer's volume goes before the driver does, as deploy/README.md's uninstall asks.
    cluster.kubectl("delete", "-n", test_namespace, "pods,pvc", "--all", "--grace-period=1", "--wait=true",
                    "--timeout=120s", timeout=150)
    assert not session.release_volumes(cluster, [], delete_namespaces=False)
    _helm(built, cluster, "uninstall", RELEASE, "--wait", "--timeout=5m")
    assert not _helm_releases(cluster, built)
    deploy.wait_until(lambda: not cluster.kubectl("get", "namespace", deploy.DRIVER_NAMESPACE, "--ignore-not-found",
                                                  "-o", "name").stdout.strip(), 180, "the csi-qsd namespace to go")
    assert _chart_objects_left(cluster, built) == []
    assert not deploy.get_json(cluster, "-n", deploy.DRIVER_NAMESPACE, "csistoragecapacities")["items"]
