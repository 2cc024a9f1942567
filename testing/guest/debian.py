"""Fetches Debian packages for the guest without installing them on the host.

The guest kernel and userland come from the same Debian archive the host
already trusts, via ``apt-get download`` + ``dpkg-deb -x``: no maintainer
scripts run, nothing lands in the host's dpkg database, and the exact versions
are whatever apt resolves today, so a security update of the kernel simply
produces a new cache entry.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

KERNEL_META_PACKAGE = "linux-image-amd64"
BUSYBOX_PACKAGE = "busybox-static"


class PackageError(RuntimeError):
    """apt could not resolve or fetch a package the guest needs."""


@dataclass(frozen=True)
class PackageRef:
    name: str
    version: str


@dataclass(frozen=True)
class GuestPackages:
    kernel: PackageRef
    busybox: PackageRef

    @property
    def kernel_release(self) -> str:
        """``uname -r`` of the guest kernel, e.g. ``6.1.0-56-amd64``."""
        return self.kernel.name.removeprefix("linux-image-")


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise PackageError(f"{cmd[0]} not found: the guest image is built from Debian packages") from exc
    if proc.returncode != 0:
        raise PackageError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _candidates(names: list[str]) -> dict[str, dict[str, str]]:
    """Returns the candidate stanza (``apt-cache show``) of each package, by name."""
    out = _run(["apt-cache", "show", "--no-all-versions", *names])
    stanzas: dict[str, dict[str, str]] = {}
    for block in out.strip().split("\n\n"):
        fields = dict(
            (m.group(1), m.group(2)) for m in re.finditer(r"^([\w-]+): (.*)$", block, re.MULTILINE)
        )
        if "Package" in fields:
            stanzas.setdefault(fields["Package"], fields)
    missing = [n for n in names if n not in stanzas]
    if missing:
        raise PackageError(f"apt knows no candidate for {missing}; run `apt-get update`")
    return stanzas


def resolve_packages() -> GuestPackages:
    """Resolves the versioned kernel package behind the meta package, and busybox.

    One ``apt-cache`` call costs under a second; callers cache the outcome.
    """
    first = _candidates([KERNEL_META_PACKAGE, BUSYBOX_PACKAGE])
    depends = first[KERNEL_META_PACKAGE].get("Depends", "")
    match = re.search(r"(linux-image-\d[^\s,(]*)", depends)
    if match is None:
        raise PackageError(f"cannot find the versioned kernel in {KERNEL_META_PACKAGE} Depends: {depends!r}")
    kernel_name = match.group(1)
    kernel = _candidates([kernel_name])[kernel_name]
    busybox = first[BUSYBOX_PACKAGE]
    return GuestPackages(
        kernel=PackageRef(kernel_name, kernel["Version"]),
        busybox=PackageRef(BUSYBOX_PACKAGE, busybox["Version"]),
    )


def download_and_extract(packages: list[PackageRef], workdir: Path, root: Path) -> None:
    """Downloads exact package versions into ``workdir`` and unpacks them into ``root``."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = ["apt-get", "download", "-q"]
    if os.geteuid() == 0:
        # apt drops to the _apt user for downloads, which cannot write into a
        # root-owned private temp dir; downloading as root is what apt falls
        # back to anyway, this only silences its warning.
        cmd += ["-o", "APT::Sandbox::User=root"]
    _run(cmd + [f"{p.name}={p.version}" for p in packages], cwd=workdir)
    for deb in sorted(workdir.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root)])
