"""A tier missing a tool fails in CI and is skipped elsewhere, and every skipped tier is listed once with its reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testing import tiers


@pytest.fixture(autouse=True)
def fresh_ledger(monkeypatch: pytest.MonkeyPatch) -> Iterator[tiers.Ledger]:
    ledger = tiers.Ledger()
    monkeypatch.setattr(tiers, "LEDGER", ledger)
    yield ledger


class Item:
    """What `enforce` reads of a pytest item: its marks."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str) -> Iterator[pytest.Mark]:
        return (m for m in self.marks if m.name == name)


@pytest.mark.parametrize(("value", "ci"), [("true", True), ("TRUE", True), ("1", True), ("yes", True),
                                           ("false", False), ("0", False), ("", False)])
def test_ci_is_the_ci_variable_set_to_true(value: str, ci: bool) -> None:
    assert tiers.in_ci({"CI": value}) is ci
    assert tiers.in_ci({}) is False


def test_nothing_missing_is_no_verdict_in_ci_or_not() -> None:
    assert tiers.verdict("cluster", [], ci=True) is None
    assert tiers.verdict("cluster", "", ci=False) is None


def test_in_ci_a_missing_tool_fails_naming_the_tier_and_the_tools() -> None:
    decided = tiers.verdict("cluster", ["go", "podman"], ci=True)
    assert decided is not None and decided.fail
    assert "cluster tier" in decided.message and "go, podman" in decided.message and "CI" in decided.message


def test_outside_ci_a_missing_tool_skips_naming_it() -> None:
    assert tiers.verdict("integration", "fio", ci=False) == tiers.Verdict(False, "integration: missing fio")


def test_an_opt_in_tier_skips_even_in_ci() -> None:
    decided = tiers.verdict("integration (NVMe over VFIO)", "set CSI_QSD_TEST_NVME_PCI", ci=True, opt_in=True)
    assert decided == tiers.Verdict(False, "integration (NVMe over VFIO): set CSI_QSD_TEST_NVME_PCI")


def test_require_fails_in_ci_and_records_nothing(fresh_ledger: tiers.Ledger) -> None:
    with pytest.raises(pytest.fail.Exception, match="e2e tier cannot run in CI: missing qemu-system-x86_64"):
        tiers.require("e2e", ["qemu-system-x86_64"], environ={"CI": "true"})
    assert fresh_ledger.lines() == []


def test_require_skips_outside_ci_and_records_the_tier(fresh_ledger: tiers.Ledger) -> None:
    for _ in range(2):
        with pytest.raises(pytest.skip.Exception, match="e2e: missing qemu-system-x86_64"):
            tiers.require("e2e", ["qemu-system-x86_64"], environ={})
    tiers.require("e2e", [], environ={"CI": "true"})  # nothing missing: returns
    assert fresh_ledger.lines() == ["skipped tier e2e: missing qemu-system-x86_64 (2 tests)"]


def test_enforce_applies_every_needs_mark_of_the_item(monkeypatch: pytest.MonkeyPatch) -> None:
    item = Item(pytest.mark.e2e, tiers.needs("e2e", []), tiers.needs("cluster", ["go"]))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="cluster tier cannot run in CI: missing go"):
        tiers.enforce(item)  # type: ignore[arg-type]
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="cluster: missing go"):
        tiers.enforce(item)  # type: ignore[arg-type]
    tiers.enforce(Item(tiers.needs("e2e", "")))  # type: ignore[arg-type]


def test_the_report_is_one_line_a_tier_printed_and_appended_to_the_named_file(
        fresh_ledger: tiers.Ledger, tmp_path: Path) -> None:
    fresh_ledger.add("cluster", "cluster: missing go")
    fresh_ledger.add("integration", "integration: missing fio")
    fresh_ledger.add("cluster", "cluster: missing go")
    printed: list[str] = []
    out = tmp_path / "skipped"
    out.write_text("skipped tier from an earlier pass (1 test)\n")
    tiers.report(printed.append, {tiers.REPORT_FILE_ENV: str(out)})
    assert printed == ["skipped tier cluster: missing go (2 tests)", "skipped tier integration: missing fio (1 test)"]
    assert out.read_text().splitlines() == ["skipped tier from an earlier pass (1 test)", *printed]


def test_an_empty_ledger_prints_and_writes_nothing(tmp_path: Path) -> None:
    printed: list[str] = []
    tiers.report(printed.append, {tiers.REPORT_FILE_ENV: str(tmp_path / "skipped")})
    assert printed == [] and not (tmp_path / "skipped").exists()
