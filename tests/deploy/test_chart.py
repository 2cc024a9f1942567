"""charts/csi-qsd is scripts/gen_chart.py's output from deploy/: committed as generated, every object of deploy/
in it, and the generator stops when deploy/ moves a field it turns into a value.

That the chart renders the same objects as `kubectl kustomize deploy/` is checked with the real `helm` and
`kubectl` in the cluster tier (e2e/cluster/test_helm.py), where both are built.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from testing.manifests.objects import DEPLOY_DIR, Obj

REPO = DEPLOY_DIR.parent
CHART = REPO / "charts" / "csi-qsd"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("csi_qsd_gen_chart", REPO / "scripts" / "gen_chart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_chart_is_the_generators_output() -> None:
    generated = _generator().generate()
    on_disk = {str(p.relative_to(CHART)): p.read_text() for p in CHART.rglob("*")
               if p.is_file() and p.name not in ("README.md", "NOTES.txt", ".helmignore")}
    assert sorted(on_disk) == sorted(generated), "charts/csi-qsd has files the generator does not write, or lacks some"
    stale = [name for name, text in generated.items() if on_disk[name] != text]
    assert not stale, f"{stale} differ from deploy/: run `python scripts/gen_chart.py`"


def _without_template_lines(text: str) -> list[Obj]:
    """A template's objects with its lines of template actions dropped and its inline actions blanked: enough to
    name each object."""
    lines = [line for line in text.splitlines() if not re.fullmatch(r"\s*\{\{.*\}\}\s*", line)]
    plain = re.sub(r"\{\{.*?\}\}", "x", "\n".join(lines))
    return [d for d in yaml.safe_load_all(plain) if isinstance(d, dict)]


def test_every_object_of_deploy_is_in_the_chart(base: list[Obj]) -> None:
    templated = [o for p in sorted((CHART / "templates").glob("*.yaml")) for o in _without_template_lines(p.read_text())]
    assert sorted(o["kind"] for o in templated) == sorted(o["kind"] for o in base)
    names = {o["metadata"]["name"] for o in templated}
    # StorageClass and Namespace names are values; every other object keeps deploy/'s name.
    assert {o["metadata"]["name"] for o in base if o["kind"] not in ("StorageClass", "Namespace")} <= names


def test_values_default_to_deploys_fields(base: list[Obj]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    [ds] = [o for o in base if o["kind"] == "DaemonSet"]
    images = {c["name"]: c["image"] for c in ds["spec"]["template"]["spec"]["containers"]}
    assert f"{values['image']['repository']}:{values['image']['tag']}" == images["csi-qsd"] == images["qsd"]
    assert {v["image"] for v in values["sidecars"].values()} == set(images.values()) - {images["csi-qsd"]}
    classes = {o["metadata"]["name"]: o for o in base if o["kind"] == "StorageClass"}
    assert {c["name"] for c in values["storageClasses"].values()} == set(classes)
    for entry in values["storageClasses"].values():
        assert entry["parameters"] == classes[entry["name"]]["parameters"]
        assert entry["enabled"] and not entry["default"]


def test_generator_stops_when_deploy_moves_a_field_it_templates(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    moved = tmp_path / "deploy"
    shutil.copytree(DEPLOY_DIR, moved)
    node = moved / "node.yaml"
    node.write_text(node.read_text().replace("- --peers-from-pods=", "- --peers-from-pod-label="))
    generator = _generator()
    monkeypatch.setattr(generator, "DEPLOY", moved)
    with pytest.raises(SystemExit, match="--peers-from-pods="):
        generator.generate()
