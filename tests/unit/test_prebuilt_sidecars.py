"""How the cluster tier finds the upstream registrar and livenessprobe builds and checks them against node.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing import shared_bin, tiers
from testing.cluster import prebuilt

README = """| binary | repository, tag (commit) | what it is |
|---|---|---|
| `csi-sanity` | kubernetes-csi/csi-test v5.5.0 (2f1e2f2aa8b7) | the CSI conformance suite |
| `livenessprobe` | kubernetes-csi/livenessprobe v2.19.0 (d2d15a5e8217) | the sidecar that answers `/healthz` |
| `not-a-release` | somewhere, no tag | prose |
"""


def test_readme_rows_give_repository_tag_and_commit() -> None:
    rows = shared_bin.readme_releases(README)
    assert rows == {"csi-sanity": ("kubernetes-csi/csi-test", "v5.5.0", "2f1e2f2aa8b7"),
                    "livenessprobe": ("kubernetes-csi/livenessprobe", "v2.19.0", "d2d15a5e8217")}


def test_an_image_tag_other_than_the_binarys_is_refused_naming_both() -> None:
    prebuilt.check_tag("registry.k8s.io/sig-storage/livenessprobe:v2.19.0", "v2.19.0", "livenessprobe")
    with pytest.raises(ValueError, match=r"livenessprobe:v2\.20\.0.*livenessprobe is v2\.19\.0"):
        prebuilt.check_tag("registry.k8s.io/sig-storage/livenessprobe:v2.20.0", "v2.19.0", "livenessprobe")


def test_node_yaml_names_an_image_for_each_prebuilt_sidecar() -> None:
    images = prebuilt.node_yaml_images(prebuilt.NODE_YAML.read_text())
    assert images["node-driver-registrar"] == "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0"
    assert images["liveness-probe"] == "registry.k8s.io/sig-storage/livenessprobe:v2.19.0"


def test_a_directory_without_the_binaries_misses_both(tmp_path: Path) -> None:
    assert prebuilt.missing(tmp_path) == [str(tmp_path / "csi-node-driver-registrar"), str(tmp_path / "livenessprobe")]
    assert prebuilt.missing(tmp_path / "absent") == [str(tmp_path / "absent" / s.binary) for s in prebuilt.SIDECARS]


@tiers.needs("cluster", prebuilt.missing())
def test_the_shipped_node_yaml_agrees_with_the_release_builds() -> None:
    found = {r.sidecar.container: r for r in prebuilt.releases()}
    assert set(found) == {"node-driver-registrar", "liveness-probe"}
    for release in found.values():
        assert release.image.endswith(f":{release.tag}")
        assert len(release.sha256) == 64
