"""The test trees' layering, and one name per file across the code.

`testing/` is the test support both `tests/` and `e2e/` run on: they import
from it and never from each other, and it imports neither, so a helper has
one home and no tree depends on a test module of another. A file's name
says what it holds, once: two files called alike in different folders make a
reader (and a traceback) ask which one is meant.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TREES = ("csi_qsd", "testing", "tests", "e2e", "scripts")
# Names a tool requires: every package has an __init__.py, pytest reads conftest.py, kustomize kustomization.yaml.
REQUIRED_NAMES = frozenset({"__init__.py", "conftest.py", "kustomization.yaml"})
# Names the driver's own package still holds twice (each in its own subpackage); this list may only shrink.
PACKAGE_SHARED_NAMES = frozenset({"base.py", "client.py", "config.py", "errors.py", "server.py", "vhost_user.py"})
# Which top-level trees each tree must not import.
FORBIDDEN = {"tests": {"e2e"}, "e2e": {"tests"}, "testing": {"tests", "e2e"}}


def python_files(tree: str) -> list[Path]:
    return sorted(p for p in (REPO / tree).rglob("*.py") if "__pycache__" not in p.parts)


def imported_trees(path: Path) -> set[str]:
    """The top-level packages `path` imports (absolute imports only: relative ones stay in their package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("tree", sorted(FORBIDDEN))
def test_a_test_tree_imports_only_downward(tree: str) -> None:
    offenders = {str(path.relative_to(REPO)): sorted(imported_trees(path) & FORBIDDEN[tree])
                 for path in python_files(tree)}
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"{tree}/ imports what it must not: {offenders}"


def files_by_name() -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = defaultdict(list)
    for tree in TREES:
        for path in (REPO / tree).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                by_name[path.name].append(str(path.relative_to(REPO)))
    return by_name


def test_no_two_files_share_a_name() -> None:
    shared = {name: sorted(paths) for name, paths in files_by_name().items()
              if len(paths) > 1 and name not in REQUIRED_NAMES}
    outside_the_package = {name: paths for name, paths in shared.items()
                           if name not in PACKAGE_SHARED_NAMES or any(not p.startswith("csi_qsd/") for p in paths)}
    assert not outside_the_package, f"files that share a name: {outside_the_package}"


def test_the_package_s_list_of_shared_names_only_shrinks() -> None:
    by_name = files_by_name()
    resolved = sorted(name for name in PACKAGE_SHARED_NAMES if len(by_name.get(name, [])) < 2)
    assert not resolved, f"no longer shared: take {resolved} off PACKAGE_SHARED_NAMES"
