"""The benches that need the cluster, at their smallest, on the tier's own cluster: one claim, one storage e2e test.

Each runs the bench's own measuring and printing functions (its `main` would
start a second cluster, and only one runs on a machine), and checks it printed
its columns, so a refactor cannot break either silently. The figures are not
judged: the full runs are `python -m e2e.bench.pvc_to_running` and
`python -m e2e.bench.storage_e2e`.
"""

from __future__ import annotations

import re

import pytest

from e2e.bench import pvc_to_running
from e2e.bench import storage_e2e as storage_bench
from e2e.cluster import conftest
from testing.cluster import storage_suite
from testing.cluster.build import Built
from testing.cluster.cluster import Cluster

pytestmark = conftest.cluster_marks()


def test_pvc_to_running_bench_measures_one_claim(cluster: Cluster, test_namespace: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    baseline = pvc_to_running.measure_baseline(cluster, test_namespace, 1)
    csi = pvc_to_running.measure_csi(cluster, test_namespace, 1)
    pvc_to_running.report(csi, baseline, "not asked in the smoke test")
    out = capsys.readouterr().out
    for line in ("PVC created -> pod Running, 1 claims", "baseline: the pod with an emptyDir",
                 "ratio csi-qsd / emptyDir pod", "of which CreateVolume (driver)", "NodeStage + NodePublish (driver)",
                 "kubelet and container start (rest)", "the driver's share of PVC -> Running"):
        assert line in out, out
    assert csi[0].running >= csi[0].bound > 0, csi


def test_storage_e2e_bench_runs_one_test(cluster: Cluster, built: Built) -> None:
    focus = storage_suite.SMOKE
    keep = cluster.logs / "storage-e2e" / "bench-smoke"
    result = storage_suite.run_suite(cluster, built.kubernetes / "e2e.test", keep, focus=focus, timeout_minutes=10)
    out = storage_bench.summary([("", result)], "not asked in the smoke test", focus, storage_suite.ALWAYS_SKIP, keep)
    assert re.search(r"csi-qsd\s+1\s+0\s+\d+\s+\d+", out), f"{out}\n(log: {result.output})"
    assert "csi-driver-host-path  not run" in out, out
