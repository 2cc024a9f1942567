"""deploy/overlays/cascade/ fits together: a block claim of the backing class, handed at one device path to
both the plugin and QSD, served as the device pool its StorageClass names; the README's overlay on top renders."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from csi_qsd.cli import build_parser
from testing.manifests.kustomize import UnsupportedKustomization, render
from testing.manifests.objects import DEPLOY_DIR, Obj, container, one, readme_overlay

CASCADE_DIR = DEPLOY_DIR / "overlays" / "cascade"


@pytest.fixture
def cascade() -> list[Obj]:
    return render(CASCADE_DIR)


def pod_of(objects: list[Obj]) -> Obj:
    spec: Obj = one(objects, "DaemonSet", "csi-qsd-node")["spec"]["template"]["spec"]
    return spec


def claim_of(pod: Obj) -> Obj:
    volume = next(v for v in pod["volumes"] if v["name"] == "cascade-pool")
    spec: Obj = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    return spec


def test_the_claim_is_a_block_device_of_the_backing_class(cascade: list[Obj]) -> None:
    claim = claim_of(pod_of(cascade))
    assert claim["volumeMode"] == "Block"
    assert claim["accessModes"] == ["ReadWriteOnce"]
    assert claim["storageClassName"] == "csi-qsd-cascade-backing"
    assert claim["resources"]["requests"]["storage"]


def test_plugin_and_qsd_see_the_claim_where_the_pool_flag_says(cascade: list[Obj]) -> None:
    pod = pod_of(cascade)
    paths = {name: [d["devicePath"] for d in container(pod, name).get("volumeDevices") or []
                    if d["name"] == "cascade-pool"] for name in ("csi-qsd", "qsd")}
    assert paths["csi-qsd"] == paths["qsd"] and len(paths["qsd"]) == 1, paths
    args = build_parser().parse_args(container(pod, "csi-qsd")["args"])
    pools = args.device_pool
    assert [(p.name, str(p.path), p.force) for p in pools] == [("cascade", paths["qsd"][0], False)]
    storage_class = one(cascade, "StorageClass", "csi-qsd-cascade")
    assert storage_class["parameters"]["pool"] == "cascade"
    assert storage_class["provisioner"] == "csi-qsd.io"


def test_the_overlay_changes_nothing_else(cascade: list[Obj], base: list[Obj]) -> None:
    def key(obj: Obj) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    unchanged = {key(o): o for o in base if key(o) != ("DaemonSet", "csi-qsd-node")}
    rendered = {key(o): o for o in cascade}
    assert set(rendered) - set(unchanged) == {("DaemonSet", "csi-qsd-node"), ("StorageClass", "csi-qsd-cascade")}
    assert all(rendered[k] == o for k, o in unchanged.items())


def test_the_readme_overlay_chooses_the_backing_class(tmp_path: Path) -> None:
    overlay = readme_overlay(CASCADE_DIR / "README.md", "my-cascade", CASCADE_DIR, tmp_path)
    claim = claim_of(pod_of(render(overlay)))
    assert claim["storageClassName"] == "ceph-rbd"
    assert claim["resources"]["requests"]["storage"] == "500Gi"


def test_a_json_patch_that_tests_the_wrong_volume_is_refused(tmp_path: Path) -> None:
    patch = "- {op: test, path: /spec/template/spec/volumes/0/name, value: cascade-pool}"
    target = {"group": "apps", "version": "v1", "kind": "DaemonSet", "name": "csi-qsd-node"}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [str(CASCADE_DIR)], "patches": [{"target": target, "patch": patch}]}))
    with pytest.raises(ValueError, match="test failed"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [str(CASCADE_DIR)], "patches": [{"target": target, "patch": "metadata: {name: x}"}]}))
    with pytest.raises(UnsupportedKustomization, match="only JSON patches"):
        render(tmp_path)
