"""Static checks of Dockerfile and .dockerignore (no container engine here)."""

from __future__ import annotations

import json
import re
import tomllib

from tests.deploy.helpers import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
PACKAGES = {"qemu-system-common", "qemu-utils", "fuse3", "e2fsprogs", "xfsprogs", "util-linux"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends in a continuation"
    return result


def test_base_image_is_bookworm_python_311() -> None:
    froms = [args for keyword, args in instructions() if keyword == "FROM"]
    assert froms, "no FROM"
    assert re.fullmatch(r"python:3\.11(\.\d+)?-(slim-)?bookworm", froms[-1].split()[0]), froms[-1]


def test_installs_the_tools() -> None:
    runs = " ".join(args for keyword, args in instructions() if keyword == "RUN")
    installs = re.findall(r"apt-get install ([^&;]*)", runs)
    assert installs
    packages = {word for words in installs for word in words.split() if not word.startswith("-")}
    missing = PACKAGES - packages
    assert not missing, f"not installed: {missing}"
    assert "--no-install-recommends" in runs
    assert "rm -rf /var/lib/apt/lists" in runs


def test_installs_the_package_and_its_entry_point() -> None:
    steps = instructions()
    copies = [args for keyword, args in steps if keyword == "COPY"]
    assert any(args.split()[0] == "." for args in copies), "the build context must be copied for `pip install`"
    runs = [args for keyword, args in steps if keyword == "RUN"]
    assert any(re.search(r"\bpip install (--\S+ )*(\.|/src)\b", args) for args in runs)
    (entrypoint,) = [args for keyword, args in steps if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["csi-qsd"]
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "csi-qsd" in scripts


def ignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (`**` spans directories, `*` and `?` do not)."""
    out = ""
    index = 0
    pattern = pattern.strip("/")
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out += "(?:.*/)?"
            index += 3
        elif pattern.startswith("**", index):
            out += ".*"
            index += 2
        elif pattern[index] == "*":
            out += "[^/]*"
            index += 1
        elif pattern[index] == "?":
            out += "[^/]"
            index += 1
        elif pattern[index] == "[":
            close = pattern.index("]", index)
            out += pattern[index : close + 1]
            index = close + 1
        else:
            out += re.escape(pattern[index])
            index += 1
    return re.compile(out)


def ignored(path: str) -> bool:
    """Whether Docker leaves `path` out of the build context (a matched directory drops its contents)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in ignore_patterns():
        negate = pattern.startswith("!")
        regex = pattern_regex(pattern.lstrip("!"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            result = not negate
    return result


def test_dockerignore_excludes_local_state() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "csi_qsd/__pycache__/cli.cpython-311.pyc",
                 ".pytest_cache/v", ".mypy_cache/3.11"):
        assert ignored(path), f"{path} would be sent to the builder"


def test_dockerignore_keeps_what_pip_install_needs() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "csi_qsd/__init__.py", "csi_qsd/cli.py"]
    readme = pyproject["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    for path in needed:
        assert not ignored(path), f"{path} is needed by `pip install .` but ignored"
