"""Each test's time limit is its tier's, or its own mark's seconds under its tier's rule for fixtures."""

from __future__ import annotations

import pytest

from testing.timeouts import DEFAULT, Limit, limit_for


@pytest.mark.parametrize(("path", "expected"), [
    ("tests/unit/test_tiers.py", Limit(120, False)),
    ("tests/deploy/test_example_manifests.py", Limit(120, False)),
    ("tests/integration/test_lifecycle.py", Limit(600, False)),
    ("tests/image/test_image.py", Limit(900, True)),
    ("e2e/test_vm_volumes.py", Limit(900, True)),
    ("e2e/cluster/test_examples.py", Limit(900, True)),
    ("e2e/cluster/test_storage_e2e.py", Limit(2700, True)),
    ("elsewhere/test_x.py", DEFAULT),
])
def test_the_tier_gives_the_limit(path: str, expected: Limit) -> None:
    assert limit_for(path) == expected


def test_a_prefix_matches_whole_path_components_only() -> None:
    assert limit_for("e2e-other/test_x.py") == DEFAULT
    assert limit_for("tests_more/test_x.py") == DEFAULT


def test_an_explicit_limit_keeps_its_tiers_rule_for_fixtures() -> None:
    assert limit_for("e2e/cluster/test_vm_pod.py", 2400) == Limit(2400, True)
    assert limit_for("tests/integration/test_x.py", 30) == Limit(30, False)
    assert limit_for("elsewhere/test_x.py", 5) == Limit(5, DEFAULT.func_only)


def test_a_cluster_test_waits_longer_than_a_unit_test() -> None:
    assert limit_for("e2e/cluster/test_deploy.py").seconds > limit_for("tests/integration/x.py").seconds \
        > limit_for("tests/unit/x.py").seconds
