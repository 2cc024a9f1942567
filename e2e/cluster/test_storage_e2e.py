"""The Kubernetes storage e2e suite's whole External Storage set against csi-qsd, as deployed with
`kubectl apply -k`, checked against the list of tests expected to pass (`storage-e2e-expected.txt`).

Every suite the driver claims (provisioning, volumes, volumeIO, snapshots,
volume-expand, volumeMode, multiVolume, ephemeral, readWriteOncePod,
volume-modify, capacity, topology, ...), filesystem and block. Any failed
test or suite node, a non-zero exit of `e2e.test`, an expected test that did
not pass or a passing one missing from the list fails the run.
"""

from __future__ import annotations

from e2e.cluster import conftest
from testing.cluster import storage_suite
from testing.cluster.build import Built
from testing.cluster.cluster import Cluster

pytestmark = conftest.cluster_marks()

# e2e.test processes side by side: a test mostly waits for pods and volumes, so three fit on two cores.
PROCS = 3


def test_whole_storage_e2e_set_passes_as_expected(cluster: Cluster, built: Built) -> None:
    # Under the cluster's logs, which are kept after the run.
    work = cluster.logs / "storage-e2e" / "whole-set"
    runs = storage_suite.run_full_set(cluster, built.kubernetes / "e2e.test", work, procs=PROCS, timeout_minutes=40)
    for label, run in runs:
        conftest.report(f"Kubernetes storage e2e, External Storage, {label}: {run.counts()}")
    expected = storage_suite.expected_passes()
    problems = storage_suite.verdict([run for _, run in runs], expected)
    conftest.report(f"Kubernetes storage e2e: {len(expected)} expected to pass, {len(problems)} problems")
    assert not problems, "\n".join(problems) + f"\n(logs: {work})"
