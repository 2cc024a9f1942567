"""How the storage e2e suite's JUnit report is counted (testing/cluster/storage_suite.py)."""

from __future__ import annotations

from pathlib import Path

from testing.cluster.storage_suite import EXPECTED, SuiteResult, read_junit, verdict

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


def test_a_failed_suite_node_is_kept_apart(tmp_path: Path) -> None:
    report = tmp_path / "junit_01.xml"
    report.write_text(REPORT.replace('<testcase name="[SynchronizedBeforeSuite]" status="passed"></testcase>',
                                     '<testcase name="[SynchronizedBeforeSuite]" status="failed">'
                                     '<failure message="no nodes">no nodes</failure></testcase>'))
    result = read_junit(report)
    assert result.setup_failed == ["[SynchronizedBeforeSuite]"]
    assert "1 suite nodes failed" in result.counts()


PASSING = "[It] External Storage [Driver: csi-qsd.io] volumes should store data"


def test_the_set_as_expected_has_no_problem() -> None:
    assert verdict([SuiteResult(passed=[PASSING])], {PASSING}) == []


def test_an_expected_test_that_did_not_pass_fails_the_set() -> None:
    problems = verdict([SuiteResult(passed=[])], {PASSING})
    assert problems == [f"expected to pass, did not: {PASSING}"]


def test_a_new_pass_a_failure_and_a_bad_exit_each_fail_the_set() -> None:
    run = SuiteResult(passed=[PASSING, "[It] new"], failed=["[It] broken"], exit_code=1,
                      setup_failed=["[SynchronizedAfterSuite]"])
    problems = verdict([run], {PASSING})
    assert len(problems) == 4, problems
    assert problems[0].startswith("e2e.test exited 1") and "suite node failed" in problems[1]
    assert problems[2] == "failed: [It] broken" and "not on the expected list" in problems[3]


def test_the_checked_in_list_is_sorted_and_names_only_our_driver() -> None:
    names = [line for line in EXPECTED.read_text().splitlines() if line and not line.startswith("#")]
    assert names == sorted(set(names)) and len(names) > 80
    assert all(name.startswith("[It] External Storage [Driver: csi-qsd.io]") for name in names)
