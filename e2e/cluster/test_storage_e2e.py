"""The Kubernetes storage e2e suite's focused set against csi-qsd, as deployed with `kubectl apply -k`.

One or two tests from each suite the driver claims (provisioning, volumes,
volumeIO, snapshots, volume-expand, volumeMode, multiVolume, ephemeral),
filesystem and block; the full set is `e2e/bench/storage_e2e.py`.
"""

from __future__ import annotations

from e2e.cluster import conftest, storage_e2e
from e2e.cluster.build import Built
from e2e.cluster.cluster import Cluster

pytestmark = conftest.cluster_marks()

# e2e.test processes side by side: a test mostly waits for pods and volumes, so three fit on two cores.
PROCS = 3


def test_focused_storage_e2e_set_passes(cluster: Cluster, built: Built) -> None:
    # Under the cluster's logs, which are kept after the run.
    work = cluster.logs / "storage-e2e"
    e2e_test = built.kubernetes / "e2e.test"
    result = storage_e2e.run_suite(cluster, e2e_test, work / "shipped-classes",
                                   focus="|".join(storage_e2e.FOCUSED), timeout_minutes=20, procs=PROCS)
    conftest.report(f"Kubernetes storage e2e, focused set, shipped classes: {result.counts()}")
    fs_type = storage_e2e.online_growable_fs()
    growth = storage_e2e.run_suite(cluster, e2e_test, work / f"fs-expansion-{fs_type}",
                                   focus="|".join(storage_e2e.FS_EXPANSION), fs_type=fs_type,
                                   timeout_minutes=10, procs=PROCS)
    conftest.report(f"Kubernetes storage e2e, filesystem expansion ({fs_type}): {growth.counts()}")
    for run, patterns in ((result, storage_e2e.FOCUSED), (growth, storage_e2e.FS_EXPANSION)):
        assert not run.failed, f"{run.counts()}; failed: {run.failed} (log: {run.output})"
        # Every focused test must have run: one the suite skipped (a capability lost) is a failure here.
        assert len(run.passed) == len(patterns), f"{run.counts()}; passed: {run.passed} (log: {run.output})"
