"""Every rendered object is valid: built-in kinds against the Kubernetes OpenAPI
schemas (strict: unknown fields are errors), custom resources against
crd_schemas.py."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest

from testing.manifests.kustomize import CLUSTER_SCOPED_KINDS, load_yaml_documents, render
from testing.manifests.objects import (
    CERT_MANAGER_DIR,
    DEPLOY_DIR,
    EXAMPLES_DIR,
    SNAPSHOT_METADATA_DIR,
    SNAPSHOT_METADATA_SERVICE,
    Obj,
)
from tests.deploy.crd_schemas import SCHEMAS

K8S_VERSION = kubernetes_validate.latest_version()
CLUSTER_SCOPED = CLUSTER_SCOPED_KINDS | {"VolumeSnapshotClass", "SnapshotMetadataService"}


def _objects() -> list[tuple[str, Obj]]:
    rendered = [(where, obj) for where, directory in (
        ("base", DEPLOY_DIR), ("examples", EXAMPLES_DIR), ("snapshot-metadata", SNAPSHOT_METADATA_DIR),
        ("cert-manager", CERT_MANAGER_DIR)) for obj in render(directory)]
    return rendered + [("snapshot-metadata", obj) for obj in load_yaml_documents(SNAPSHOT_METADATA_SERVICE)]


def _id(item: tuple[str, Obj]) -> str:
    where, obj = item
    return f"{where}:{obj['kind']}/{obj['metadata']['name']}"


def validate(obj: Obj) -> None:
    """Raise if `obj` is invalid; every object must be covered by some schema."""
    custom = SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if custom is not None:
        jsonschema.Draft202012Validator(custom).validate(obj)
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"no schema for {obj['apiVersion']} {obj['kind']}: add one to crd_schemas.py")


@pytest.mark.parametrize("item", _objects(), ids=_id)
def test_object_is_valid(item: tuple[str, Obj]) -> None:
    validate(item[1])


@pytest.mark.parametrize("item", _objects(), ids=_id)
def test_namespace_matches_scope(item: tuple[str, Obj]) -> None:
    where, obj = item
    namespace = obj["metadata"].get("namespace")
    if obj["kind"] in CLUSTER_SCOPED:
        assert namespace is None, "cluster-scoped objects carry no namespace"
    elif where != "examples":
        assert namespace == "csi-qsd"
    else:
        assert namespace is None, "examples go into the namespace they are applied to"


def test_schema_checks_catch_mistakes(base: list[Obj], examples: list[Obj]) -> None:
    """The validation above would notice an unknown field, in built-in and custom kinds alike."""
    daemonset = copy.deepcopy(next(o for o in base if o["kind"] == "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["mountPropogation"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(daemonset)

    storage_class = copy.deepcopy(next(o for o in base if o["kind"] == "StorageClass"))
    storage_class["parameters"]["detectZeroes"] = False  # what an unquoted `off` becomes
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(storage_class)

    for kind, path, value in [
        ("VolumeSnapshotClass", ["deletionPolicy"], "Keep"),
        ("VolumeSnapshot", ["spec", "source", "pvcName"], "x"),
        ("VirtualMachine", ["spec", "template", "spec", "domain", "devices", "disk"], []),
        ("VirtualMachine", ["spec", "running"], True),
    ]:
        obj = copy.deepcopy(next(o for o in base + examples if o["kind"] == kind))
        node = obj
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(obj)


def test_volume_snapshot_source_needs_exactly_one(examples: list[Obj]) -> None:
    snapshot = copy.deepcopy(next(o for o in examples if o["kind"] == "VolumeSnapshot"))
    snapshot["spec"]["source"]["volumeSnapshotContentName"] = "content"
    with pytest.raises(jsonschema.ValidationError):
        validate(snapshot)
    snapshot["spec"]["source"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(snapshot)


def test_base_and_examples_are_separate(base: list[Obj]) -> None:
    workload_kinds = {"PersistentVolumeClaim", "Pod", "VirtualMachine", "VolumeSnapshot", "ConfigMap"}
    assert not [o for o in base if o["kind"] in workload_kinds]
    text = (DEPLOY_DIR / "kustomization.yaml").read_text(encoding="utf-8")
    assert "examples" not in text.split("resources:", 1)[1].split("images:", 1)[0]
