"""scripts/install-go.sh decides from `go version` output, read as numbers, whether a Go is new enough.

The script's functions are run in bash on sample lines; nothing is installed. The host's `go` is
looked for on PATH leaving out the venv's bin directory, where the script's own link lives.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-go.sh"
BASH = shutil.which("bash") or "/bin/bash"


def _bash(snippet: str, *args: str, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASH, "-c", f'source "{SCRIPT}"; {snippet}', "bash", *args],
                          capture_output=True, text=True, env={"PATH": path, "LC_ALL": "C"}, timeout=30)


@pytest.mark.parametrize(("line", "minimum", "new_enough"), [
    ("go version go1.26.8 linux/amd64", "1.26.0", True),
    ("go version go1.26.0 linux/amd64", "1.26.0", True),
    ("go version go1.27.3 linux/arm64", "1.26.0", True),
    ("go version go1.100.0 linux/amd64", "1.26.0", True),  # numbers, not strings: 100 > 26
    ("go version go2.0.0 linux/amd64", "1.26.0", True),
    ("go version go1.26.6 X:nocoverageredesign linux/amd64", "1.26.0", True),
    ("go version devel go1.27-4f2a9b1c Tue Mar 3 10:00:00 2026 +0000 linux/amd64", "1.26.0", True),
    ("go version go1.25.9 linux/amd64", "1.26.0", False),
    ("go version go1.19.8 linux/amd64", "1.26.0", False),  # Debian 12's golang-go
    ("go version go1.9 linux/amd64", "1.26.0", False),
    ("go version go1.26rc1 linux/amd64", "1.26.0", False),  # a release candidate comes before its .0
    ("go version go1.26beta2 linux/amd64", "1.26.0", False),
    ("go version go1.26 linux/amd64", "1.26.0", False),  # Go orders go1.26 before go1.26.0
    ("go version go1.26.5 linux/amd64", "1.26.6", False),
    ("go version go1.26.6 linux/amd64", "1.26.6", True),
    ("", "1.26.0", False),
    ("bash: line 1: go: command not found", "1.26.0", False),
    ("go: downloading go1.27.0 (linux/amd64)", "1.26.0", False),  # a message, not a version line
    ("go version go1.26.8x linux/amd64", "1.26.0", False),
])
def test_go_at_least(line: str, minimum: str, new_enough: bool) -> None:
    result = _bash('go_at_least "$1" "$2"', line, minimum)
    assert result.stderr == ""
    assert (result.returncode == 0) is new_enough, (line, minimum)


def _fake_go(directory: Path, version_line: str) -> Path:
    directory.mkdir(parents=True)
    go = directory / "go"
    go.write_text(f'#!/bin/sh\necho "{version_line}"\n')
    go.chmod(0o755)
    return go


def test_host_go_leaves_out_the_venv_bin(tmp_path: Path) -> None:
    own = _fake_go(tmp_path / "venv" / "bin", "go version go1.26.6 linux/amd64")
    host = _fake_go(tmp_path / "usr" / "local" / "go" / "bin", "go version go1.25.1 linux/amd64")
    path = f"{own.parent}:{host.parent}:/usr/bin:/bin"
    assert _bash('host_go "$1"', str(own.parent), path=path).stdout.strip() == str(host)
    # the venv's bin named another way (a trailing slash, a relative path) is still left out
    assert _bash('host_go "$1"', f"{own.parent}/", path=path).stdout.strip() == str(host)
    assert _bash('cd "$1" && host_go venv/bin', str(tmp_path), path=path).stdout.strip() == str(host)


def test_host_go_none(tmp_path: Path) -> None:
    own = _fake_go(tmp_path / "venv" / "bin", "go version go1.26.6 linux/amd64")
    result = _bash('host_go "$1"', str(own.parent), path=f"{own.parent}:{tmp_path / 'empty'}")
    assert result.returncode == 0 and result.stdout == ""


def test_version_of_keeps_the_toolchain_local(tmp_path: Path) -> None:
    go = tmp_path / "go"
    go.write_text('#!/bin/sh\necho "go version go1.26.8 linux/amd64 GOTOOLCHAIN=$GOTOOLCHAIN"\n')
    go.chmod(0o755)
    assert _bash('GOTOOLCHAIN=go1.27.0 version_of "$1"', str(go)).stdout.strip().endswith("GOTOOLCHAIN=local")
