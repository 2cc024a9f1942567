"""deploy/README.md stays in step with the manifests it describes."""

from __future__ import annotations

import re

import pytest

from testing.manifests.objects import DEPLOY_DIR, DRIVER_VERSION, EXAMPLES_DIR, PARAMETERS, Obj, one, select

README = (DEPLOY_DIR / "README.md").read_text(encoding="utf-8")


def test_sidecar_versions_match_node_yaml(base: list[Obj]) -> None:
    pod = one(base, "DaemonSet")["spec"]["template"]["spec"]
    for spec in pod["containers"]:
        repository, _, tag = spec["image"].rpartition(":")
        if not repository.startswith("registry.k8s.io/sig-storage/"):
            continue
        name = repository.rsplit("/", 1)[1]
        assert re.search(rf"\|\s*{re.escape(name)}\s*\|\s*{re.escape(tag)}\s*\|", README), (
            f"README's sidecar table does not list {name} {tag}"
        )


def test_driver_version_mentioned() -> None:
    assert f"`{DRIVER_VERSION}`" in README


@pytest.mark.parametrize("key", sorted(PARAMETERS))
def test_every_parameter_documented(key: str) -> None:
    assert f"| `{key}` |" in README


def test_storage_classes_documented(base: list[Obj]) -> None:
    for sc in select(base, "StorageClass"):
        name = sc["metadata"]["name"]
        row = next((line for line in README.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} has no row in the StorageClass table"
        for key, value in sc["parameters"].items():
            assert re.search(rf"`{re.escape(key)}: \"?{re.escape(value)}\"?`", row), f"{name}: {key}={value}"


def test_examples_documented() -> None:
    files = sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    listed = sorted(re.findall(r"^\| `([\w.-]+\.yaml)` \|", README, flags=re.MULTILINE))
    assert listed == files


def test_prerequisites_and_install() -> None:
    for needle in (
        "kubectl apply -k deploy/",
        "--enable-distributed-snapshotting",
        "/var/lib/kubelet",
        "/dev/fuse",
        "pod-security.kubernetes.io/enforce: privileged",
        "updateStrategy: OnDelete",
        "VolumeExpansion: OFFLINE",
        "kubectl delete -k deploy/",
    ):
        assert needle in README, needle


# ---------------------------------------------------------------------------
# The top-level README's "Deploy on Kubernetes" section.

_TOP_README = (DEPLOY_DIR.parent / "README.md").read_text(encoding="utf-8")
SECTION = _TOP_README[_TOP_README.index("## Deploy on Kubernetes"):]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_section_links_resolve() -> None:
    anchors = {github_anchor(line.lstrip("#")) for line in README.splitlines() if line.startswith("#")}
    links = re.findall(r"\]\((deploy/[^)#]+)(?:#([^)]+))?\)", SECTION)
    assert links
    for path, anchor in links:
        assert (DEPLOY_DIR.parent / path).is_file(), path
        if anchor:
            assert path == "deploy/README.md" and anchor in anchors, f"no heading for #{anchor}"


def test_section_names_files_that_exist() -> None:
    for path in set(re.findall(r"deploy/[\w./-]+\.yaml", SECTION)):
        assert (DEPLOY_DIR.parent / path).is_file(), path


def test_section_lists_the_classes(base: list[Obj]) -> None:
    listed = re.findall(r"^\| `(csi-qsd-[\w-]+)` \|", SECTION, flags=re.MULTILINE)
    assert sorted(listed) == sorted(sc["metadata"]["name"] for sc in select(base, "StorageClass"))
    vm = one(base, "StorageClass", "csi-qsd-vm")
    assert f"`numQueues` ({vm['parameters']['numQueues']})" in SECTION


def test_section_image_and_metrics_port(base: list[Obj]) -> None:
    assert f"ghcr.io/csi-qsd/csi-qsd:{DRIVER_VERSION}" in SECTION
    pod = one(base, "DaemonSet")["spec"]["template"]["spec"]
    plugin = next(c for c in pod["containers"] if c["name"] == "csi-qsd")
    (address,) = [a.split("=", 1)[1] for a in plugin["args"] if a.startswith("--metrics-address=")]
    port = address.rsplit(":", 1)[1]
    assert f"port {port}" in SECTION and f"port {port}" in README
    assert "--enable-distributed-snapshotting" in SECTION and "kubectl apply -k deploy/" in SECTION
