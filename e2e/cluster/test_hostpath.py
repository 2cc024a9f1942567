"""csi-driver-host-path beside csi-qsd in the same cluster: both drivers serve a filesystem and a block claim.

host-path is deployed from testing/cluster/hostpath/ (its own namespace, the
same sidecars, a WaitForFirstConsumer class) with its release build from
../shared/bin. Each test runs the same pod on both drivers' classes, checks
the bytes, and reports each claim's time from creation to a running pod.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import conftest
from testing import shared_bin, tiers
from testing.cluster import deploy
from testing.cluster import examples as ex
from testing.cluster.build import HOSTPATH_IMAGE
from testing.cluster.cluster import Cluster

pytestmark = [*conftest.cluster_marks(),
              tiers.needs("cluster", [] if shared_bin.find("hostpathplugin") else
                          [str(shared_bin.directory() / "hostpathplugin")])]

CLASSES = {"csi-qsd": {"filesystem": "csi-qsd-fs", "block": "csi-qsd-block"},
           "host-path": {"filesystem": "csi-hostpath", "block": "csi-hostpath"}}
WRITE = {"filesystem": "echo {token} > /data/token && sync /data/token && cat /data/token",
         "block": "echo {token} | dd of=/dev/xvda conv=fsync 2>/dev/null && head -c 32 /dev/xvda"}


@pytest.fixture(scope="module")
def hostpath(cluster: Cluster) -> Iterator[Cluster]:
    deploy.deploy_hostpath(cluster)
    pod = deploy.get_json(cluster, "-n", deploy.HOSTPATH_NAMESPACE, "pods")["items"][0]
    assert {c["image"] for c in pod["spec"]["containers"]} >= {HOSTPATH_IMAGE}
    yield cluster


def _claim_and_pod(name: str, klass: str, mode: str) -> list[dict[str, Any]]:
    block = mode == "block"
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
             "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": klass,
                      "volumeMode": "Block" if block else "Filesystem",
                      "resources": {"requests": {"storage": "64Mi"}}}}
    container: dict[str, Any] = {"name": "app", "image": "docker.io/library/busybox:1.36", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "exec sleep 3600000"]}
    if block:
        container["volumeDevices"] = [{"name": "v", "devicePath": "/dev/xvda"}]
    else:
        container["volumeMounts"] = [{"name": "v", "mountPath": "/data"}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"terminationGracePeriodSeconds": 1, "containers": [container],
                    "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": name}}]}}
    return [claim, pod]


@pytest.mark.parametrize("mode", ["filesystem", "block"])
def test_both_drivers_serve_the_same_pod(hostpath: Cluster, test_namespace: str, mode: str) -> None:
    took = {}
    for driver, classes in CLASSES.items():
        name = f"{driver}-{mode}"
        start = time.monotonic()
        ex.apply(hostpath, test_namespace, _claim_and_pod(name, classes[mode], mode))
        ex.wait_pod_running(hostpath, test_namespace, name)
        took[driver] = time.monotonic() - start
        out = ex.pod_exec(hostpath, test_namespace, name, WRITE[mode].format(token=name))
        assert out.startswith(name), out
        claim = deploy.get_json(hostpath, "-n", test_namespace, "pvc", name)
        pv = deploy.get_json(hostpath, "pv", claim["spec"]["volumeName"])
        assert pv["spec"]["csi"]["driver"] == {"csi-qsd": "csi-qsd.io", "host-path": deploy.HOSTPATH_DRIVER}[driver]
    conftest.report(f"one {mode} claim to a running pod, polled each second: "
                    + ", ".join(f"{driver} {seconds:.1f} s" for driver, seconds in took.items()))
