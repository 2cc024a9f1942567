"""The architecture page and the contributor guide point at what exists, and the README leads to both.

Pure file reading. Both pages name many files and modules, and they are the
first pages a newcomer follows, so a rename that leaves them behind must
fail here: every relative link resolves (as everywhere, `test_docs`), every
file or directory path they name (`csi_qsd/…`, `tests/…`, `scripts/…`,
`docs/…`, …) exists, every dotted `csi_qsd.…` module they name is one, and
the layer diagram has a box for every layer `test_layering` enforces.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests.unit.test_docs import REPO, Page, link_problems, link_targets
from tests.unit.test_layering import LAYERS

PAGES = (REPO / "docs" / "architecture.md", REPO / "CONTRIBUTING.md")
# A path from the project root: one of its top directories, then anything a file name holds.
PATH = re.compile(r"(?<![\w./~$-])((?:csi_qsd|tests|testing|e2e|scripts|docs|deploy|charts|proto)/[\w./-]*)")
MODULE = re.compile(r"(?<![\w./])csi_qsd(?:\.[A-Za-z_]\w*)+")
MERMAID = re.compile(r"^```mermaid\n(.*?)^```", re.MULTILINE | re.DOTALL)


def named_paths(text: str) -> set[str]:
    """The project paths a page names, in prose or code, without a sentence's closing dot."""
    return {match.rstrip(".") for match in PATH.findall(text)}


def path_problems(pages: tuple[Path, ...], root: Path = REPO) -> list[str]:
    return [f"{page.name}: names {path}, which does not exist"
            for page in pages for path in sorted(named_paths(page.read_text(encoding="utf-8")))
            if not (root / path).exists()]


def is_module(name: str, root: Path = REPO) -> bool:
    """True if `name` is a module or package of the project: its file is there, or it imports."""
    relative = Path(*name.split("."))
    if (root / relative.with_suffix(".py")).is_file() or (root / relative / "__init__.py").is_file():
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def module_problems(pages: tuple[Path, ...], root: Path = REPO) -> list[str]:
    return [f"{page.name}: names module {name}, which is none"
            for page in pages for name in sorted(set(MODULE.findall(page.read_text(encoding="utf-8"))))
            if not is_module(name, root)]


def test_both_pages_exist_and_the_readme_links_them() -> None:
    for page in PAGES:
        assert page.is_file(), f"{page.relative_to(REPO)} is missing"
    linked = {target.partition("#")[0] for target in link_targets(Page.read(REPO / "README.md"))}
    assert {"docs/architecture.md", "CONTRIBUTING.md"} <= linked, "README.md must link both pages"


def test_every_relative_link_in_them_resolves() -> None:
    problems = link_problems(list(PAGES))
    assert not problems, "\n".join(problems)


def test_every_path_they_name_exists() -> None:
    assert len(set().union(*(named_paths(p.read_text(encoding="utf-8")) for p in PAGES))) > 40, "no paths found"
    problems = path_problems(PAGES)
    assert not problems, "\n".join(problems)


def test_every_module_they_name_is_one() -> None:
    problems = module_problems(PAGES)
    assert not problems, "\n".join(problems)


def test_the_layer_diagram_has_every_layer() -> None:
    diagram = MERMAID.search(PAGES[0].read_text(encoding="utf-8"))
    assert diagram, "docs/architecture.md has no Mermaid diagram"
    missing = sorted(unit for layer in LAYERS for unit in layer
                     if not re.search(rf"csi_qsd/{unit}(?:/|\.py)", diagram.group(1)))
    assert not missing, f"the layer diagram lacks {missing}"


def test_a_missing_path_or_module_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `csi_qsd/node/staging.py`, `tests/unit/` and csi_qsd/nowhere.py.\n"
        "```sh\n.venv/bin/python -m pytest tests/unit/test_gone.py ~/.cache/csi-qsd/cluster\n```\n"
        "`csi_qsd.qsd.attach` calls csi_qsd.qsd.client, not `csi_qsd.qsd.nothing` or csi_qsd.gone.module.\n"
    )
    paths = path_problems((page,))
    assert [p.split(" names ")[1].split(",")[0] for p in paths] == ["csi_qsd/nowhere.py", "tests/unit/test_gone.py"]
    modules = module_problems((page,))
    assert [m.split(" module ")[1].split(",")[0] for m in modules] == ["csi_qsd.gone.module", "csi_qsd.qsd.nothing"]
