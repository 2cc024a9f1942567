"""The cluster tier's check that the tests naming each example ran and passed: the verdict, and its place last."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.cluster import conftest

TEST = "e2e/cluster/test_examples.py::test_x"


@pytest.fixture(autouse=True)
def outcomes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[str, str]]]:
    recorded: dict[str, list[tuple[str, str]]] = {}
    monkeypatch.setattr(conftest, "_OUTCOMES", recorded)
    return recorded


def passed() -> list[tuple[str, str]]:
    return [("setup", "passed"), ("call", "passed"), ("teardown", "passed")]


def test_a_test_that_did_not_run_is_said_so() -> None:
    assert conftest.outcome(TEST) == "did not run in this run"


def test_every_parameter_must_pass_every_phase(outcomes: dict[str, list[tuple[str, str]]]) -> None:
    outcomes[f"{TEST}[ext4]"] = passed()
    outcomes[f"{TEST}[xfs]"] = passed()
    outcomes[f"{TEST}_other"] = [("setup", "failed")]  # another test whose name starts alike
    assert conftest.outcome(TEST) == "passed"
    outcomes[f"{TEST}[xfs]"] = [("setup", "passed"), ("call", "passed"), ("teardown", "failed")]
    assert conftest.outcome(TEST) == f"{TEST}[xfs]: teardown failed"


def test_a_skip_is_not_a_pass(outcomes: dict[str, list[tuple[str, str]]]) -> None:
    outcomes[TEST] = [("setup", "skipped"), ("teardown", "passed")]
    assert conftest.outcome(TEST) == f"{TEST}: setup skipped"


class Item:
    def __init__(self, path: Path, last: bool = False) -> None:
        self.path = path
        self.last = last

    def get_closest_marker(self, name: str) -> object:
        return self.last if name == conftest.LAST else None


def test_the_check_moves_behind_the_tiers_last_test_and_stays_in_its_package() -> None:
    tier = Path(conftest.__file__).parent
    check = Item(tier / "test_examples.py", last=True)
    items = [Item(tier / "test_deploy.py"), check, Item(tier / "test_vm_pod.py"), Item(tier.parent / "test_vm_qos.py")]
    expected = [items[0], items[2], check, items[3]]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert items == expected
