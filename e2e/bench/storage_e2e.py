"""The Kubernetes storage e2e suite's full External Storage set against csi-qsd, beside csi-driver-host-path.

Starts the cluster tier's cluster (`e2e/cluster/`), deploys csi-qsd with
`kubectl apply -k`, and runs every External Storage test of `e2e.test` the
driver's test-driver file enables (`e2e/cluster/storage_e2e.py`), one at a
time or (``--procs``) in several `e2e.test` processes under the Ginkgo CLI,
except those that stop the node or kubelet (`[Disruptive]`), need Windows or
are marked flaky upstream. It prints passed, failed and skipped,
then each failed test. csi-driver-host-path's column is filled when its
module can be fetched here; otherwise the Go module proxy's answer is printed
in its place. In three processes the whole set takes about 11 minutes on two
cores with the cluster's start; one at a time, over an hour.

Usage:

    .venv/bin/python -m e2e.bench.storage_e2e [--focus REGEX] [--fs-type xfs]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from e2e.cluster import storage_e2e
from e2e.cluster.build import build_all
from e2e.cluster.session import deployed_cluster

# The suite is not yet run with a test-driver file for host-path (e2e/cluster/hostpath/ deploys it).
HOSTPATH_NOT_RUN = "this bench has no test-driver file for it yet"


def summary(result: storage_e2e.SuiteResult, focus: str, skip: str, keep: Path, hostpath: str,
            growth: tuple[str, storage_e2e.SuiteResult] | None = None) -> str:
    """What the bench prints: the counts beside csi-driver-host-path's (or why it was not run), each failed test;
    with `growth`, the filesystem expansion tests run on another filesystem (its name) on their own line."""
    runs = [result, *([growth[1]] if growth else [])]
    return "\n".join([
        f"Kubernetes storage e2e (External Storage, focus {focus!r}, skipping {skip!r}):",
        f"  csi-qsd               {result.counts()}",
        *([f"  csi-qsd, filesystem expansion on {growth[0]} (ext4 grows in use only with CAP_SYS_RESOURCE, which "
           f"this host withholds): {growth[1].counts()}"] if growth else []),
        f"  csi-driver-host-path  not run: {hostpath}",
        *(f"  FAILED {name}" for run in runs for name in run.failed),
        f"  the suite's log and JUnit report: {keep}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--focus", default=".", help="only the External Storage tests matching this")
    parser.add_argument("--fs-type", default="", help="the shipped filesystem class with this default filesystem")
    parser.add_argument("--timeout-minutes", type=int, default=150)
    parser.add_argument("--procs", type=int, default=3,
                        help="e2e.test processes run side by side under the Ginkgo CLI (default 3; 1: one at a time)")
    args = parser.parse_args(argv)
    built = build_all()
    keep = Path(tempfile.mkdtemp(prefix="csi-qsd-storage-e2e-", dir="/var/tmp"))
    growable = storage_e2e.online_growable_fs()
    # Where the class's filesystem cannot grow in use here, its expansion tests run on one that can.
    apart = args.fs_type in ("", "ext4") and growable != "ext4"
    skip = storage_e2e.ALWAYS_SKIP + ("|" + "|".join(storage_e2e.FS_EXPANSION) if apart else "")
    with deployed_cluster(built) as cluster:
        e2e_test = built.kubernetes / "e2e.test"
        result = storage_e2e.run_suite(cluster, e2e_test, keep, focus=args.focus, skip=skip,
                                       fs_type=args.fs_type, timeout_minutes=args.timeout_minutes,
                                       procs=args.procs)
        growth = None
        if apart and args.focus == ".":  # the full set
            growth = (growable, storage_e2e.run_suite(cluster, e2e_test, keep / f"fs-expansion-{growable}",
                                                      focus="|".join(storage_e2e.FS_EXPANSION), fs_type=growable,
                                                      timeout_minutes=20, procs=args.procs))
    print(summary(result, args.focus, skip, keep, HOSTPATH_NOT_RUN, growth))
    return 0

if __name__ == "__main__":
    sys.exit(main())
