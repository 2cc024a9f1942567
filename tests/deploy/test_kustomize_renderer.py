"""The offline kustomize renderer does what `kustomize build` does for the features it covers."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.manifests.kustomize import UnsupportedKustomization, render, split_image


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_resources_in_order_with_nested_kustomization(tmp_path: Path) -> None:
    _write(tmp_path / "kustomization.yaml", "resources:\n  - a.yaml\n  - sub\n  - b.yaml\n")
    _write(tmp_path / "a.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\n"
           "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a2}\n")
    _write(tmp_path / "sub" / "kustomization.yaml", "resources: [c.yaml]\n")
    _write(tmp_path / "sub" / "c.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    _write(tmp_path / "b.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n")
    assert [o["metadata"]["name"] for o in render(tmp_path)] == ["a", "a2", "c", "b"]


def test_namespace_like_kustomize(tmp_path: Path) -> None:
    _write(tmp_path / "kustomization.yaml", "namespace: ns1\nresources: [r.yaml]\n")
    _write(
        tmp_path / "r.yaml",
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: sa}\n---\n"
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {name: sc}\nprovisioner: x\n---\n"
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: crb}\n"
        "roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: r}\n"
        "subjects:\n  - {kind: ServiceAccount, name: sa}\n  - {kind: ServiceAccount, name: other, namespace: keep}\n"
        "---\napiVersion: snapshot.storage.k8s.io/v1\nkind: VolumeSnapshotClass\nmetadata: {name: vsc}\n"
        "driver: x\ndeletionPolicy: Delete\n",
    )
    sa, sc, crb, vsc = render(tmp_path)
    assert sa["metadata"]["namespace"] == "ns1"
    assert "namespace" not in sc["metadata"]
    assert "namespace" not in crb["metadata"]
    assert [s["namespace"] for s in crb["subjects"]] == ["ns1", "keep"]
    # kustomize does not know custom resources are cluster-scoped.
    assert vsc["metadata"]["namespace"] == "ns1"


def test_images(tmp_path: Path) -> None:
    _write(
        tmp_path / "kustomization.yaml",
        "resources: [d.yaml]\nimages:\n  - {name: example.com/app, newTag: 1.2}\n"
        "  - {name: reg:5000/other, newName: reg:5000/moved}\n  - {name: pinned, digest: 'sha256:abc'}\n",
    )
    _write(
        tmp_path / "d.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n    spec:\n"
        "      initContainers: [{name: i, image: example.com/app}]\n"
        "      containers:\n        - {name: a, image: 'example.com/app:old'}\n"
        "        - {name: b, image: 'reg:5000/other:7'}\n        - {name: c, image: pinned}\n"
        "        - {name: d, image: example.com/application}\n",
    )
    (deployment,) = render(tmp_path)
    spec = deployment["spec"]["template"]["spec"]
    assert spec["initContainers"][0]["image"] == "example.com/app:1.2"
    assert [c["image"] for c in spec["containers"]] == [
        "example.com/app:1.2",
        "reg:5000/moved:7",
        "pinned@sha256:abc",
        "example.com/application",
    ]


def test_split_image() -> None:
    assert split_image("reg:5000/a/b:1@sha256:x") == ("reg:5000/a/b", "1", "sha256:x")
    assert split_image("reg:5000/a") == ("reg:5000/a", None, None)


@pytest.mark.parametrize("key", ["patchesStrategicMerge", "commonLabels", "configMapGenerator", "helmCharts"])
def test_unsupported_features_are_refused(tmp_path: Path, key: str) -> None:
    _write(tmp_path / "kustomization.yaml", f"resources: []\n{key}: []\n")
    with pytest.raises(UnsupportedKustomization):
        render(tmp_path)


def test_missing_resource_and_duplicates_are_errors(tmp_path: Path) -> None:
    _write(tmp_path / "kustomization.yaml", "resources: [nope.yaml]\n")
    with pytest.raises(FileNotFoundError):
        render(tmp_path)
    _write(tmp_path / "kustomization.yaml", "resources: [a.yaml, a.yaml]\n")
    _write(tmp_path / "a.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    with pytest.raises(ValueError, match="duplicate"):
        render(tmp_path)
