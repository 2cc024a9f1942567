"""Every bench at its smallest: its `main` in a subprocess exits 0 and prints its columns, so no refactor breaks one.

Sizes and times are tiny (seconds each, about four minutes in all on two
cores); the figures are not judged, only that the bench ran to the end, that
each table it prints has its columns, and that no check of its own printed
FAIL. The benches that need the cluster are `e2e/cluster/test_cluster_bench_smoke.py`.
Left out here: `scaling`'s and `encryption_layers`' VM rows, whose libblkio client is built with
mmdebstrap on first use (`e2e.bench.blkio_client`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from e2e.bench import vs_hostpath
from e2e.bench.load import Load, report
from e2e.bench.report_tables import verdict
from e2e.conftest import e2e_marks
from testing import shared_bin, tiers
from testing.harness import Sandbox

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T", bound=Callable[..., None])
TOOLS = ("fio", "qemu-storage-daemon", "qemu-img", "losetup", "mkfs.ext4", "mkfs.xfs", "unshare")

# bench module, its tiny arguments, lines (or parts of them: column headers) its output must hold
BENCHES: list[tuple[str, list[str], list[str]]] = [
    ("control_plane", ["--volumes", "2"],
     ["latency, ms (ratio = driver figure / baseline)", "p50 ratio", "memory (baseline: QSD with no volume)",
      "QSD RSS MiB", "target (from the issue)", "CreateVolume p99 < 100 ms"]),
    ("restart", ["--volumes", "3"],
     ["no volume (baseline)", "Probe ready after SIGKILL, s", "first call on an old volume, s",
      "QSD RSS per idle volume, KiB"]),
    ("load", ["--clients", "2", "--seconds", "4", "--bound", "30", "--qsd-kills", "1"],
     ["RPC / data step", "slowest step s", "failed attempts by code", "SIGKILL QSD", "SIGKILL driver",
      "PASS  nothing leaked"]),
    ("container_path", ["--runtime", "0.3", "--rounds", "1", "--region-mib", "64"],
     ["job", "csi-qsd", "spread", "baseline", "QSD CPU per thread", "filesystem: ext4 in the published volume",
      "block: the published block device", "4k randwrite QD32 (IOPS)", "1M write QD8 (MiB/s)"]),
    ("scaling", ["--qsd", "10", "--counts", "1", "--kinds", "pod", "--runtime", "0.3", "--rounds", "1"],
     ["regions", "vol xN/x1", "reg xN/x1", "FUSE in flight/vol", "pod 4k randwrite QD32", "pod 4k randread QD32"]),
    ("pod_default", ["--configs", "host:default", "--counts", "1", "--runtime", "0.3", "--rounds", "1",
                     "--region-mib", "64"],
     ["host:default: pool on", "volumes", "FUSE in flight/vol", "QSD CPU per thread (volumes' last run)",
      "4k randread QD32", "4k randwrite QD32"]),
    ("encryption_cost", ["--kinds", "pod", "--runtime", "0.3", "--rounds", "1", "--region-mib", "64"],
     ["encrypted (qcow2 + LUKS aes-256-xts) vs plain", "/proc/cpuinfo flags", "4k randread QD32", "4k randwrite QD32",
      "busy cores enc / plain"]),
    ("encryption_layers", ["--paths", "block,pod", "--ciphers", "aes-256-xts,aes-128-cbc-essiv", "--count", "2000",
                           "--seconds", "0.3", "--rounds", "1", "--size-mib", "256"],
     ["/proc/cpuinfo flags", "CPU us/IO", "4k randwrite QD32", "4k randread QD32", "qcow2-luks aes-256-xts",
      "luks/qcow2 aes-128-cbc-essiv", "pod path (QSD FUSE export", "more cores: IOPS"]),
    ("snapshot_latency", ["--sizes", "1"],
     ["latency, ms (ratio = driver p50 / baseline p50)", "CreateSnapshot, 1 GiB (published, live cut)",
      "baseline: full copy, qemu-img convert + fsync", "target: p50 < 50 ms", "1 GiB p50", "worst max"]),
    ("cbt", ["--size-gib", "0.0625", "--fio-seconds", "0.3"],
     ["delta reports (ranges)", "GetMetadataDelta (3 runs)", "block by block", "incremental backup read",
      "4 KiB: GetMetadataDelta < 1 s", "fresh volume", "after a snapshot"]),
    ("grow_by_move", ["--gib", "1"],
     ["figure", "baseline", "measured", "move and grow (NodeExpandVolume) vs dd of the volume's bytes",
      "writer p99 latency, during vs before"]),
    ("partitions", ["--runtime", "0.3", "--rounds", "1"],
     ["device region (baseline)", "partition volume", "QSD CPU per thread", "partitions at once",
      "aggregate IOPS", "vs one partition"]),
    ("partition_knobs", ["--runtime", "0.1", "--rounds", "1"],
     ["FUSE max_background", "12 (kernel default)", "4k randread QD32 (IOPS): device", "QSD CPU",
      "no QSD: direct-I/O loop device over the extent"]),
    ("partitions_vm", ["--rounds", "1", "--share", "0.05"],
     ["device region", "volume, cache: writeback", "device region, flushing", "volume, writethrough (default)",
      "QSD CPU per thread (writeback)"]),
    ("cross_node", ["--size-gib", "0.0625"],
     ["dd 0.0625 GiB over loopback TCP", "first I/O on node B", "fully local on node B", "local / dd"]),
    ("snapshot_router", ["--size-gib", "1", "--writes", "200", "--calls", "5", "--repeat", "1",
                         "--max-results", "16"],
     ["GetMetadataAllocated(S0), 16 ranges", "routed, owner cached", "first message", "whole answer",
      "router RSS"]),
    ("vhost_churn", ["--qsd", "10", "--runs", "1", "--placements", "main", "--connections", "20"],
     ["placement", "connections", "QSD died", "calls failed", "main"]),
]


def test_every_bench_has_a_smoke_run() -> None:
    benches = {p.stem for p in (REPO / "e2e" / "bench").glob("*.py")}
    helpers = {"__init__", "sizes", "latencies", "process_usage", "report_tables", "shell", "fio", "loop_devices",
               "staged_volumes", "served_bench", "blkio_client", "device_pool", "standalone_qsd"}
    in_the_cluster_tier = {"pvc_to_running", "storage_e2e"}  # e2e/cluster/test_cluster_bench_smoke.py
    assert benches - helpers - in_the_cluster_tier == {name for name, _, _ in BENCHES} | {"dataplane", "vs_hostpath"}


def run_bench(module: str, args: list[str], timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, "-m", f"e2e.bench.{module}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{module} exited {done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
    assert not re.search(r"^\s*FAIL\b|\bFAIL \(the check raised", done.stdout, re.M), done.stdout
    return done.stdout


def smoke(test: T) -> T:
    """Marked e2e; without root or a tool the benches run, failed in CI and skipped elsewhere (testing.tiers)."""
    marks = [tiers.needs("e2e", "root (the benches stage volumes: FUSE, loop devices)" if os.geteuid() != 0 else ""),
             *e2e_marks(TOOLS)]
    for mark in marks:
        test = mark(test)
    return test


@pytest.mark.parametrize(("module", "args", "expected"), BENCHES, ids=[name for name, _, _ in BENCHES])
@smoke
def test_bench_runs_at_tiny_size(module: str, args: list[str], expected: list[str]) -> None:
    out = run_bench(module, args)
    missing = [line for line in expected if line not in out]
    assert not missing, f"{module} printed none of {missing}:\n{out}"


@smoke
@e2e_marks(("qemu-system-x86_64",))[1]
def test_dataplane_runs_its_baseline_in_the_drivers_loop_mode() -> None:
    """Both tables; the ext4 baseline's loop device in the mode the driver chose for its volume (direct on 10.0.13)."""
    out = run_bench("dataplane", ["--runtime", "0.1"])
    for line in ("(a) csi-qsd", "(a') wb+wce=off", "(b) qemu wt", "(b') qemu none", "(c) host raw", "FUSE file",
                 "ext4/loop/FUSE", "ext4/loop/raw"):
        assert line in out, out
    found = re.search(r"the volume's loop device (\w+) \(loop\d+\), the baseline's (\w+) \(loop\d+\)", out)
    assert found is not None, out
    assert found.group(1) == found.group(2), found.group(0)


@smoke
@tiers.needs("e2e", "" if vs_hostpath.find_reference() else f"hostpathplugin in {shared_bin.directory()} or on PATH")
def test_vs_hostpath_runs_beside_the_served_reference() -> None:
    out = run_bench("vs_hostpath", ["--volumes", "2", "--size-mib", "64"])
    for line in ("p50, ms", "csi-qsd", "hostpathplugin (served)", "NodeStageVolume (filesystem)",
                 "Stage + Publish (block)", "target (from the issue)", "CreateVolume (block) <= 1.5x"):
        assert line in out, out


def test_a_check_that_raised_prints_fail() -> None:
    assert verdict(lambda: True) == "PASS"
    assert verdict(lambda: False) == "MISS"
    assert verdict(lambda: 1 / 0).startswith("FAIL (the check raised ZeroDivisionError")


def test_load_fails_its_leak_check_when_the_check_did_not_finish(tmp_path: Path) -> None:
    load = Load(Sandbox(tmp_path), clients=1, seconds=1, dwell=0, bound=1, qsd_kills=0)
    try:
        text, passed = report(load)
        assert not passed
        assert "FAIL (the check raised RuntimeError(\"the leak check did not finish: 'it did not run'\"))  " \
               "nothing leaked" in text, text
        load.leak_check = AttributeError("'Config' object has no attribute 'resolve'")
        text, _ = report(load)
        assert "the leak check did not finish: AttributeError" in text, text
        load.leak_check = None
        text, _ = report(load)
        assert "PASS  nothing leaked" in text, text
    finally:
        load.io.shutdown()
