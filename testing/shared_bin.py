"""Where the CSI community's prebuilt binaries are: `../shared/bin` beside the project, or `$CSI_QSD_SHARED_BIN`.

Static release builds of programs whose Go modules the proxy here refuses
(the registrar, livenessprobe, hostpathplugin); tests and benches that need
one find it here, and say so and skip without it. Only finds files: never
builds or fetches one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = "CSI_QSD_SHARED_BIN"


def directory() -> Path:
    explicit = os.environ.get(ENV)
    return Path(explicit).expanduser() if explicit else REPO.parent / "shared" / "bin"


def find(name: str, where: Path | None = None) -> Path | None:
    """The executable `name` in the directory, or None."""
    path = (where or directory()) / name
    return path if os.access(path, os.X_OK) and path.is_file() else None


_ROW = re.compile(r"^\|\s*`(?P<name>[^`]+)`\s*\|\s*(?P<repo>\S+)\s+(?P<tag>v\d+\.\d+\.\d+)\s+\((?P<commit>[0-9a-f]+)\)\s*\|",
                  re.M)


def readme_releases(readme: str) -> dict[str, tuple[str, str, str]]:
    """The directory README's table rows: binary name -> (repository, tag, commit)."""
    return {m["name"]: (m["repo"], m["tag"], m["commit"]) for m in _ROW.finditer(readme)}


def release(name: str, where: Path | None = None) -> tuple[str, str, str] | None:
    """(repository, tag, commit) of `name` as the directory's README gives it, or None."""
    readme = (where or directory()) / "README.md"
    return readme_releases(readme.read_text()).get(name) if readme.is_file() else None
