"""The Kubernetes storage e2e suite's full External Storage set against csi-qsd, beside csi-driver-host-path.

Starts the cluster tier's cluster (`testing/cluster/`), deploys csi-qsd with
`kubectl apply -k` and csi-driver-host-path beside it (`testing/cluster/hostpath/`,
its release build from ../shared/bin), and runs every External Storage test of
`e2e.test` each driver's test-driver file enables (`testing/cluster/storage_suite.py`)
in several `e2e.test` processes under the Ginkgo CLI (``--procs``), except
those that stop the node or kubelet (`[Disruptive]`), need Windows or are
marked flaky upstream. It prints one table, passed / failed / skipped per
driver, then each failed test and each test that passed for host-path and not
for csi-qsd. In three processes csi-qsd's set takes about 11 minutes on two
cores, host-path's about 6.

Usage:

    .venv/bin/python -m e2e.bench.storage_e2e [--focus REGEX] [--fs-type xfs] [--no-hostpath] [--write-expected]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from testing import shared_bin
from testing.cluster import deploy, storage_suite
from testing.cluster.build import build_all
from testing.cluster.session import deployed_cluster

Runs = list[tuple[str, storage_suite.SuiteResult]]
_DRIVER = re.compile(r"\[Driver: [^]]+\] ")


def _test(name: str) -> str:
    """A test's name without its driver, so the two drivers' tests compare."""
    return _DRIVER.sub("", name)


def only_hostpath_passed(qsd: Runs, hostpath: Runs) -> list[str]:
    """The tests that passed for host-path and not for csi-qsd."""
    passed = {_test(n) for _, run in qsd for n in run.passed}
    return sorted({_test(n) for _, run in hostpath for n in run.passed} - passed)


def summary(qsd: Runs, hostpath: Runs | str, focus: str, skip: str, keep: Path) -> str:
    """What the bench prints: one row per run of each driver (host-path's, or why it was not run), then each
    failed test and each test only host-path passed."""
    rows = [(f"csi-qsd{', ' + label if label else ''}", run) for label, run in qsd]
    if isinstance(hostpath, str):
        rows_text = [f"  csi-driver-host-path  not run: {hostpath}"]
    else:
        rows += [("csi-driver-host-path", run) for _, run in hostpath]
        rows_text = []
    width = max(len(name) for name, _ in rows)
    lines = [f"Kubernetes storage e2e (External Storage, focus {focus!r}, skipping {skip!r}):",
             f"  {'driver':<{width}}  {'passed':>6}  {'failed':>6}  {'skipped':>7}  {'seconds':>7}",
             *(f"  {name:<{width}}  {len(run.passed):>6}  {len(run.failed):>6}  {run.skipped:>7}  {run.seconds:>7.0f}"
               for name, run in rows), *rows_text]
    lines += [f"  FAILED ({name}) {test}" for name, run in rows for test in run.failed + run.setup_failed]
    if not isinstance(hostpath, str):
        lines += [f"  passed for host-path only: {test}" for test in only_hostpath_passed(qsd, hostpath)]
    lines.append(f"  the suite's logs and JUnit reports: {keep}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--focus", default=".", help="only the External Storage tests matching this")
    parser.add_argument("--fs-type", default="", help="the shipped filesystem class with this default filesystem")
    parser.add_argument("--timeout-minutes", type=int, default=150)
    parser.add_argument("--no-hostpath", action="store_true", help="csi-qsd's column only")
    parser.add_argument("--write-expected", action="store_true",
                        help=f"write the tests csi-qsd passed to {storage_suite.EXPECTED.name}, CI's list (whole set)")
    parser.add_argument("--procs", type=int, default=3,
                        help="e2e.test processes run side by side under the Ginkgo CLI (default 3; 1: one at a time)")
    args = parser.parse_args(argv)
    built = build_all()
    keep = Path(tempfile.mkdtemp(prefix="csi-qsd-storage-e2e-", dir="/var/tmp"))
    skip = storage_suite.full_set_skip(args.fs_type)
    hostpath: Runs | str = "--no-hostpath" if args.no_hostpath else ""
    if not hostpath and shared_bin.find("hostpathplugin") is None:
        hostpath = f"no hostpathplugin in {shared_bin.directory()}"
    with deployed_cluster(built) as cluster:
        e2e_test = built.kubernetes / "e2e.test"
        if args.focus == ".":  # the whole set, with the expansion tests apart where they must be
            qsd = storage_suite.run_full_set(cluster, e2e_test, keep / "csi-qsd", procs=args.procs,
                                           fs_type=args.fs_type, timeout_minutes=args.timeout_minutes)
        else:
            qsd = [("", storage_suite.run_suite(cluster, e2e_test, keep / "csi-qsd", focus=args.focus, skip=skip,
                                              fs_type=args.fs_type, timeout_minutes=args.timeout_minutes,
                                              procs=args.procs))]
        if not hostpath:
            deploy.deploy_hostpath(cluster)
            hostpath = [("", storage_suite.run_suite(cluster, e2e_test, keep / "host-path", focus=args.focus,
                                                   timeout_minutes=args.timeout_minutes, procs=args.procs,
                                                   definition=storage_suite.hostpath_definition()))]
    print(summary(qsd, hostpath, args.focus, skip, keep))
    if args.write_expected and args.focus == "." and not args.fs_type:
        storage_suite.write_expected([run for _, run in qsd])
        print(f"  wrote {storage_suite.EXPECTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
