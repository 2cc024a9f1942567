"""The cluster tier's check that the tests naming each example ran and passed: the verdict, and its place last."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.cluster import outcomes

TEST = "e2e/cluster/test_examples.py::test_x"


@pytest.fixture(autouse=True)
def recorded_outcomes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[str, str]]]:
    recorded: dict[str, list[tuple[str, str]]] = {}
    monkeypatch.setattr(outcomes, "_OUTCOMES", recorded)
    return recorded


def passed() -> list[tuple[str, str]]:
    return [("setup", "passed"), ("call", "passed"), ("teardown", "passed")]


def test_a_test_that_did_not_run_is_said_so() -> None:
    assert outcomes.outcome(TEST) == "did not run in this run"


def test_every_parameter_must_pass_every_phase(recorded_outcomes: dict[str, list[tuple[str, str]]]) -> None:
    recorded_outcomes[f"{TEST}[ext4]"] = passed()
    recorded_outcomes[f"{TEST}[xfs]"] = passed()
    recorded_outcomes[f"{TEST}_other"] = [("setup", "failed")]  # another test whose name starts alike
    assert outcomes.outcome(TEST) == "passed"
    recorded_outcomes[f"{TEST}[xfs]"] = [("setup", "passed"), ("call", "passed"), ("teardown", "failed")]
    assert outcomes.outcome(TEST) == f"{TEST}[xfs]: teardown failed"


def test_a_skip_is_not_a_pass(recorded_outcomes: dict[str, list[tuple[str, str]]]) -> None:
    recorded_outcomes[TEST] = [("setup", "skipped"), ("teardown", "passed")]
    assert outcomes.outcome(TEST) == f"{TEST}: setup skipped"


class Item:
    def __init__(self, path: Path, last: bool = False) -> None:
        self.path = path
        self.last = last

    def get_closest_marker(self, name: str) -> object:
        return self.last if name == outcomes.LAST else None


def test_the_check_moves_behind_the_tiers_last_test_and_stays_in_its_package() -> None:
    tier = Path("e2e/cluster")
    check = Item(tier / "test_examples.py", last=True)
    items = [Item(tier / "test_deploy.py"), check, Item(tier / "test_vm_pod.py"), Item(tier.parent / "test_vm_qos.py")]
    expected = [items[0], items[2], check, items[3]]
    outcomes.move_last(items, tier)
    assert items == expected
