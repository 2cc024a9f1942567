"""How the storage e2e suite's JUnit report is counted (e2e/cluster/storage_e2e.py)."""

from __future__ import annotations

from pathlib import Path

from e2e.cluster.storage_e2e import read_junit

REPORT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites>
 <testsuite name="Kubernetes e2e suite" tests="6">
  <testcase name="[SynchronizedBeforeSuite]" status="passed"></testcase>
  <testcase name="[It] External Storage [Driver: csi-qsd.io] volumes should store data" status="passed"></testcase>
  <testcase name="[It] External Storage [Driver: csi-qsd.io] volume-expand grows" status="failed">
   <failure message="timed out">timed out</failure>
  </testcase>
  <testcase name="[It] External Storage [Driver: csi-qsd.io] inline volumes" status="skipped">
   <skipped message="skipped - Driver &quot;csi-qsd.io&quot; does not support volume type &quot;InlineVolume&quot;"></skipped>
  </testcase>
  <testcase name="[It] [sig-network] a spec the focus left out" status="skipped">
   <skipped message="skipped"></skipped>
  </testcase>
  <testcase name="[It] [sig-apps] another one" status="skipped"><skipped message="skipped"></skipped></testcase>
 </testsuite>
</testsuites>
"""


def test_only_specs_the_run_selected_are_counted(tmp_path: Path) -> None:
    report = tmp_path / "junit_01.xml"
    report.write_text(REPORT)
    result = read_junit(report)
    assert result.passed == ["[It] External Storage [Driver: csi-qsd.io] volumes should store data"]
    assert result.failed == ["[It] External Storage [Driver: csi-qsd.io] volume-expand grows"]
    assert result.skipped == 1
