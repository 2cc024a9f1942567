"""The upstream node-driver-registrar and livenessprobe, from static release builds: what the node pod runs.

The Go module proxy refuses those two modules, so the cluster tier cannot
build them as it builds the other sidecars. A directory of static builds of
their release tags (`CSI_QSD_SHARED_BIN`, by default `../shared/bin`
relative to the project root) holds them, with a README table naming each
one's tag and commit. Each becomes a `FROM scratch` image holding the binary
as its entrypoint, as the upstream release image is, under the very name
deploy/node.yaml gives it: the manifests run unchanged. The binary's tag
must be the tag node.yaml names, or the build stops. Never a stand-in:
without the binaries the tier is skipped, naming what is missing.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from testing import shared_bin

NODE_YAML = shared_bin.REPO / "deploy" / "node.yaml"


@dataclass(frozen=True)
class Sidecar:
    """A sidecar of the node pod that comes prebuilt: its container in node.yaml and its file in the directory."""

    container: str
    binary: str


SIDECARS = (Sidecar("node-driver-registrar", "csi-node-driver-registrar"), Sidecar("liveness-probe", "livenessprobe"))


@dataclass(frozen=True)
class Release:
    """One prebuilt binary as found: where, which upstream release, its digest, and the image it becomes."""

    sidecar: Sidecar
    path: Path
    repository: str
    tag: str
    commit: str
    sha256: str
    image: str

    def describe(self) -> str:
        """One line for the run's summary: which program ran, at which release, from which file."""
        return (f"{self.sidecar.container}: upstream {self.sidecar.binary} {self.tag} ({self.repository} "
                f"{self.commit}), {self.path} sha256:{self.sha256[:16]}, image {self.image}")


def missing(directory: Path | None = None) -> list[str]:
    """The prebuilt sidecars' files the directory lacks (all of them when it does not exist)."""
    directory = directory or shared_bin.directory()
    return [str(directory / s.binary) for s in SIDECARS if shared_bin.find(s.binary, directory) is None]


def node_yaml_images(text: str) -> dict[str, str]:
    """The image of each container of the node DaemonSet in node.yaml's text."""
    [daemonset] = [d for d in yaml.safe_load_all(text) if d and d.get("kind") == "DaemonSet"]
    return {c["name"]: c["image"] for c in daemonset["spec"]["template"]["spec"]["containers"]}


def check_tag(image: str, tag: str, binary: str) -> None:
    """Raises ValueError when `image`'s tag is not the binary's release tag."""
    if image.rsplit(":", 1)[-1] != tag:
        raise ValueError(f"deploy/node.yaml names {image}, but {binary} is {tag}: make the two agree")


def _reported_version(path: Path) -> str | None:
    """What the binary says its version is, for the ones that say (the registrar); livenessprobe has no flag."""
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, env={"LC_ALL": "C"}, check=False)
    if done.returncode != 0:
        return None
    words = done.stdout.split()
    return words[-1] if words else None


def releases(directory: Path | None = None) -> list[Release]:
    """Each prebuilt sidecar with its release, checked against node.yaml. Raises ValueError on any disagreement."""
    directory = directory or shared_bin.directory()
    table = shared_bin.readme_releases((directory / "README.md").read_text())
    images = node_yaml_images(NODE_YAML.read_text())
    found = []
    for sidecar in SIDECARS:
        path = directory / sidecar.binary
        if sidecar.binary not in table:
            raise ValueError(f"{directory / 'README.md'} names no release for {sidecar.binary}")
        repository, tag, commit = table[sidecar.binary]
        said = _reported_version(path)
        if said is not None and said != tag:
            raise ValueError(f"{path} says it is {said}, its README says {tag}")
        image = images[sidecar.container]
        check_tag(image, tag, str(path))
        found.append(Release(sidecar, path, repository, tag, commit,
                             hashlib.sha256(path.read_bytes()).hexdigest(), image))
    return found
