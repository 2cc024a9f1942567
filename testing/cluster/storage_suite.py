"""The Kubernetes storage e2e suite (`e2e.test`'s External Storage tests) run against csi-qsd.

`e2e.test` is built from the `k8s.io/kubernetes` module at the cluster's
version. It learns about the driver from a test-driver file
(`-storage.testdriver`): the StorageClass and VolumeSnapshotClass deploy/
ships, the sizes and filesystems the driver takes, and the capabilities it
claims, each of which turns on the suite's tests for it. Counts come from
the suite's JUnit report, not from its console output.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from csi_qsd.config import TOPOLOGY_KEY_FUSE, TOPOLOGY_KEY_NODE, TOPOLOGY_KEY_VHOST_USER
from csi_qsd.sys import caps
from testing.cluster.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
STORAGE_CLASS = "csi-qsd-fs"
SNAPSHOT_CLASS = "csi-qsd-snapclass"

# What csi-qsd claims to the suite; each capability enables the suite's tests of it.
CAPABILITIES = {
    "persistence": True, "block": True, "fsGroup": True, "exec": True, "snapshotDataSource": True,
    "pvcDataSource": True, "multipods": True, "controllerExpansion": True, "nodeExpansion": True,
    "onlineExpansion": True, "offlineExpansion": True, "singleNodeVolume": True, "topology": True,
    "capacity": True, "RWX": False, "multiplePVsSameID": False,
    # The node plugin applies a pod's fsGroup itself (VOLUME_MOUNT_GROUP); the suite skips what assumes
    # kubelet's own recursive chown (fsGroupChangePolicy).
    "volumeMountGroup": True,
    # SINGLE_NODE_SINGLE_WRITER: one target at a time (`csi_qsd.node.staging`).
    "readWriteOncePod": True,
}
# A test that fails leaves its pod holding the claim, and its cleanup waits for the volume to go: bound it.
TIMEOUTS = {"PVDelete": "2m", "PVDeleteSlow": "3m", "PodDelete": "2m"}

# Never run: they stop or restart kubelet or the node (the suite expects ssh or a cloud to do it),
# need Windows, are marked flaky upstream, or need images whose modules the Go module proxy refuses
# (the volume populator test: hello-populator and volume-data-source-validator); and the topology tests
# of classes that bind at once: the driver provisions a claim on the node its first pod is scheduled to
# (WaitForFirstConsumer, deploy/README.md), so an Immediate claim is never provisioned.
ALWAYS_SKIP = r"Disruptive|Feature:Windows|Flaky|any volume data source|\(immediate binding\)\] topology"

# The one test the bench's smoke test runs.
SMOKE = r"\(default fs\)\] volumes should store data$"
# Every test of the set that passes here, one name per line (the JUnit names): CI's gate
# (`e2e/cluster/test_storage_e2e.py`). A test that stops passing, or a new one that passes, changes this file.
EXPECTED = Path(__file__).with_name("storage-e2e-expected.txt")
# The claim the volume-modify tests move between classes: one of deploy/examples' VolumeAttributesClasses.
MODIFY_CLASS = "csi-qsd-silver"
# Growing a filesystem, run with a class whose default filesystem grows online on this host: kubelet calls
# NodeExpandVolume once the pod has the volume mounted, in the offline flow too.
FS_EXPANSION = (
    r"\(default fs\)\(allowExpansion\)\] volume-expand should resize volume when PVC is edited while pod is "
    r"using it",
    r"\(default fs\)\(allowExpansion\)\] volume-expand Verify if offline PVC expansion works",
    r"\(default fs\)\(allowExpansion\)\] volume-expand should resize volume when PVC is edited and the pod is "
    r"re-created on the same node after controller resize is finished",
    r"Generic Ephemeral-volume \(default fs\) \(late-binding\)\] ephemeral should support expansion of pvcs created "
    r"for ephemeral pvcs",
)


def online_growable_fs() -> str:
    """ext4 if this host lets the plugin grow a mounted ext4 (it needs CAP_SYS_RESOURCE), else xfs.

    The plugin container is privileged, so it has what the host gives the cluster: the test's own set.
    """
    return "ext4" if caps.has(caps.CAP_SYS_RESOURCE) else "xfs"


def shipped_class_with_fs(fs_type: str) -> dict[str, object]:
    """deploy/'s filesystem StorageClass with another default filesystem (`csi.storage.k8s.io/fstype`)."""
    shipped = [d for d in yaml.safe_load_all((REPO / "deploy" / "storageclasses.yaml").read_text())
               if d and d["metadata"]["name"] == STORAGE_CLASS][0]
    shipped["metadata"]["name"] = f"{STORAGE_CLASS}-{fs_type}"
    shipped["parameters"]["csi.storage.k8s.io/fstype"] = fs_type
    return shipped  # type: ignore[no-any-return]


def modify_class() -> dict[str, object]:
    """deploy/examples' VolumeAttributesClass the volume-modify tests copy (limits a pod's I/O, changed live)."""
    examples = yaml.safe_load_all((REPO / "deploy" / "examples" / "volume-attributes-classes.yaml").read_text())
    return [d for d in examples if d and d["kind"] == "VolumeAttributesClass"  # type: ignore[no-any-return]
            and d["metadata"]["name"] == MODIFY_CLASS][0]


def driver_definition(storage_class_file: Path | None = None, modify_class_file: Path | None = None,
                      ) -> dict[str, object]:
    """The test-driver file's content (`-storage.testdriver`), as JSON, which is YAML too.

    The StorageClass is the one deploy/ ships, or the one in `storage_class_file`; with `modify_class_file`
    (a VolumeAttributesClass) the volume-modify tests run.
    """
    storage_class = ({"FromFile": str(storage_class_file)} if storage_class_file
                     else {"FromExistingClassName": STORAGE_CLASS})
    return {
        "StorageClass": storage_class,
        "SnapshotClass": {"FromExistingClassName": SNAPSHOT_CLASS},
        "DriverInfo": {
            "Name": "csi-qsd.io",
            # XFS volumes are made at least 300 MiB (mkfs.xfs's floor), and a restore must ask at least its
            # snapshot's size (external-provisioner refuses a smaller one): claims start there.
            "SupportedSizeRange": {"Min": "300Mi", "Max": "10Gi"},
            "SupportedFsType": {"": {}, "ext4": {}, "xfs": {}},
            # Every key a node reports (NodeGetInfo); the CSIStorageCapacity objects carry all of them, and the
            # capacity test expects objects of the one key it is given when it is given only one.
            "TopologyKeys": [TOPOLOGY_KEY_NODE, TOPOLOGY_KEY_FUSE, TOPOLOGY_KEY_VHOST_USER],
            "NumAllowedTopologies": 1,
            "Capabilities": CAPABILITIES,
        },
        "Timeouts": TIMEOUTS,
        **({"VolumeAttributesClass": {"FromFile": str(modify_class_file)}} if modify_class_file else {}),
    }


def hostpath_definition() -> dict[str, object]:
    """csi-driver-host-path's test-driver file as testing/cluster/hostpath/ deploys it: the provisioner alone beside
    the registrar and livenessprobe (no snapshotter, no resizer), so snapshots and expansion are not claimed."""
    return {
        "StorageClass": {"FromExistingClassName": "csi-hostpath"},
        "DriverInfo": {
            "Name": "hostpath.csi.k8s.io",
            "SupportedSizeRange": {"Min": "1Mi", "Max": "10Gi"},
            "SupportedFsType": {"": {}},
            "TopologyKeys": ["topology.hostpath.csi/node"],
            "NumAllowedTopologies": 1,
            "Capabilities": {"persistence": True, "block": True, "fsGroup": True, "exec": True, "multipods": True,
                             "singleNodeVolume": True, "topology": True, "pvcDataSource": True,
                             "readWriteOncePod": True},
        },
        "Timeouts": TIMEOUTS,
    }


@dataclass
class SuiteResult:
    """What one run of the suite did, from its JUnit report."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    setup_failed: list[str] = field(default_factory=list)  # the suite's own nodes: before/after suite, reports
    skipped: int = 0
    seconds: float = 0.0
    exit_code: int = 0
    output: Path | None = None

    def counts(self) -> str:
        setup = f", {len(self.setup_failed)} suite nodes failed" if self.setup_failed else ""
        return (f"{len(self.passed)} passed, {len(self.failed)} failed, {self.skipped} skipped{setup} "
                f"in {self.seconds:.0f} s")


def read_junit(report: Path) -> SuiteResult:
    """Passed, failed and skipped specs of a JUnit report, and the suite's own nodes that failed (the specs the
    run's focus and skip left out are not counted)."""
    result = SuiteResult()
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("[It]"):
            if case.find("failure") is not None or case.find("error") is not None:
                result.setup_failed.append(name)
            continue
        skipped = case.find("skipped")
        if skipped is not None:
            # Ginkgo reports a spec its focus or skip left out as plainly "skipped"; one the suite skipped
            # while running (the driver lacks what it needs) says why.
            if skipped.get("message", "") != "skipped":
                result.skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            result.failed.append(name)
        else:
            result.passed.append(name)
    return result


def run_suite(cluster: Cluster, e2e_test: Path, work: Path, *, focus: str, skip: str = ALWAYS_SKIP,
              fs_type: str = "", timeout_minutes: int = 30, procs: int = 1,
              definition: dict[str, object] | None = None) -> SuiteResult:
    """Run the External Storage tests matching `focus` against the deployed driver.

    One at a time, or with `procs` > 1 in that many `e2e.test` processes under the Ginkgo CLI built beside
    it: most of a test's time is spent waiting for pods and volumes, so a 2-core node runs several at once.
    With `fs_type`, the shipped filesystem class is used with that default filesystem instead. With
    `definition`, another driver's test-driver file (`hostpath_definition`) in place of csi-qsd's.
    """
    work.mkdir(parents=True, exist_ok=True)
    class_file = None
    if fs_type:
        class_file = work / f"storageclass-{fs_type}.yaml"
        class_file.write_text(json.dumps(shipped_class_with_fs(fs_type), indent=1))
    modify_file = work / "volumeattributesclass.yaml"
    modify_file.write_text(json.dumps(modify_class(), indent=1))
    driver = work / "csi-qsd-driver.yaml"
    driver.write_text(json.dumps(definition or driver_definition(class_file, modify_file), indent=1))
    report = work / "report"
    suite_flags = [
        f"-kubeconfig={cluster.admin_kubeconfig}", f"-kubectl-path={cluster.bin['kubectl']}",
        f"-storage.testdriver={driver}", "-provider=skeleton", "-minStartupPods=0", f"-report-dir={report}",
    ]
    ginkgo_flags = [f"focus=External.Storage.*({focus})", f"skip={skip}", f"timeout={timeout_minutes}m", "no-color"]
    if procs > 1:
        argv = [str(e2e_test.parent / "ginkgo"), f"--procs={procs}", *(f"--{flag}" for flag in ginkgo_flags),
                str(e2e_test), "--", *suite_flags]
    else:
        argv = [str(e2e_test), *suite_flags, *(f"-ginkgo.{flag}" for flag in ginkgo_flags)]
    output = work / "e2e.log"
    started = time.monotonic()
    with open(output, "w") as log:
        finished = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                  env={**os.environ, "LC_ALL": "C"}, timeout=timeout_minutes * 60 + 120)
    reports = sorted(report.glob("junit*.xml"))
    if not reports:
        raise RuntimeError(f"e2e.test exited {finished.returncode} without a report (see {output})")
    result = read_junit(reports[0])
    result.seconds = time.monotonic() - started
    result.exit_code = finished.returncode
    result.output = output
    return result


def full_set_skip(fs_type: str = "") -> str:
    """The skip pattern of the whole set: `ALWAYS_SKIP`, and the filesystem expansion tests where the class's
    filesystem cannot grow in use here (they run on one that can: `run_full_set`)."""
    apart = fs_type in ("", "ext4") and online_growable_fs() != "ext4"
    return ALWAYS_SKIP + ("|" + "|".join(FS_EXPANSION) if apart else "")


def run_full_set(cluster: Cluster, e2e_test: Path, work: Path, *, procs: int, timeout_minutes: int,
                 fs_type: str = "") -> list[tuple[str, SuiteResult]]:
    """Every External Storage test the driver's file enables, with the shipped classes (or `fs_type`), and the
    filesystem expansion tests apart on a filesystem that grows in use here if the class's cannot."""
    skip = full_set_skip(fs_type)
    runs = [(fs_type or "shipped classes", run_suite(cluster, e2e_test, work, focus=".", skip=skip, fs_type=fs_type,
                                                      timeout_minutes=timeout_minutes, procs=procs))]
    if skip != ALWAYS_SKIP:
        growable = online_growable_fs()
        runs.append((f"filesystem expansion on {growable}",
                     run_suite(cluster, e2e_test, work / f"fs-expansion-{growable}", focus="|".join(FS_EXPANSION),
                               fs_type=growable, timeout_minutes=20, procs=procs)))
    return runs


def expected_passes() -> set[str]:
    """The checked-in list of tests that pass (`EXPECTED`)."""
    return {line for line in EXPECTED.read_text().splitlines() if line and not line.startswith("#")}


def write_expected(runs: list[SuiteResult]) -> None:
    """Make the checked-in list the tests these runs passed."""
    passed = sorted({name for run in runs for name in run.passed})
    EXPECTED.write_text("# The External Storage tests that pass against csi-qsd: CI's gate (test_storage_e2e.py).\n"
                        "# Remade by `python -m e2e.bench.storage_e2e --write-expected`.\n" + "\n".join(passed) + "\n")


def verdict(runs: list[SuiteResult], expected: set[str]) -> list[str]:
    """What makes the set fail CI, one line each: a non-zero exit, a failed suite node or test, an expected test
    that did not pass, a test that passed and is not on the list (empty: the set is as expected)."""
    problems = [f"e2e.test exited {run.exit_code} (log: {run.output})" for run in runs if run.exit_code]
    problems += [f"suite node failed: {name}" for run in runs for name in run.setup_failed]
    problems += [f"failed: {name}" for run in runs for name in run.failed]
    passed = {name for run in runs for name in run.passed}
    problems += [f"expected to pass, did not: {name}" for name in sorted(expected - passed)]
    problems += [f"passed, not on the expected list (add it to {EXPECTED.name}): {name}"
                 for name in sorted(passed - expected)]
    return problems
