"""CSIDriver, StorageClasses, VolumeSnapshotClass, RBAC and the driver image."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from testing.manifests.objects import (
    DEPLOY_DIR,
    DRIVER_IMAGE,
    DRIVER_NAME,
    DRIVER_VERSION,
    NAMESPACE,
    PARAMETERS,
    REPO_ROOT,
    Obj,
    container,
    one,
    select,
)

VHOST_ONLY = {"numQueues", "logicalBlockSize", "cache", "discard", "detectZeroes"}


def test_csidriver(base: list[Obj]) -> None:
    driver = one(base, "CSIDriver")
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "fsGroupPolicy": "File",
        "storageCapacity": True,
        "volumeLifecycleModes": ["Persistent"],
    }


def test_namespace_allows_privileged_pods(base: list[Obj]) -> None:
    namespace = one(base, "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


@pytest.mark.parametrize("name", ["csi-qsd-vm", "csi-qsd-fs", "csi-qsd-block"])
def test_storage_class_common(base: list[Obj], name: str) -> None:
    sc = one(base, "StorageClass", name)
    assert sc["provisioner"] == DRIVER_NAME
    assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
    assert sc["allowVolumeExpansion"] is True
    assert sc.get("reclaimPolicy", "Delete") in ("Delete", "Retain")
    for key, value in sc.get("parameters", {}).items():
        assert key in PARAMETERS, f"{name}: the driver does not accept parameter {key!r}"
        allowed = PARAMETERS[key]
        assert isinstance(value, str)
        if isinstance(allowed, re.Pattern):
            assert allowed.fullmatch(value), f"{name}: {key}={value!r}"
        else:
            assert value in allowed, f"{name}: {key}={value!r} not in {sorted(allowed)}"
    parameters = sc.get("parameters", {})
    if parameters.get("format") == "raw":
        assert parameters.get("preallocation") != "metadata", "metadata preallocation is qcow2-only"


def test_only_the_three_storage_classes(base: list[Obj]) -> None:
    assert sorted(sc["metadata"]["name"] for sc in select(base, "StorageClass")) == [
        "csi-qsd-block",
        "csi-qsd-fs",
        "csi-qsd-vm",
    ]
    assert not [
        sc
        for sc in select(base, "StorageClass")
        if (sc["metadata"].get("annotations") or {}).get("storageclass.kubernetes.io/is-default-class")
    ], "installing the driver must not change the cluster's default class"


def test_vm_class(base: list[Obj]) -> None:
    parameters = one(base, "StorageClass", "csi-qsd-vm")["parameters"]
    assert parameters["export"] == "vhost-user-blk"
    assert "csi.storage.k8s.io/fstype" not in parameters
    assert parameters.get("cache", "writethrough") == "writethrough"
    if parameters.get("detectZeroes") == "unmap":
        assert parameters.get("discard") == "unmap"


def test_fs_class(base: list[Obj]) -> None:
    parameters = one(base, "StorageClass", "csi-qsd-fs")["parameters"]
    assert parameters.get("export", "filesystem") == "filesystem"
    assert parameters["csi.storage.k8s.io/fstype"] == "ext4"
    assert not VHOST_ONLY & set(parameters)


def test_block_class(base: list[Obj]) -> None:
    parameters = one(base, "StorageClass", "csi-qsd-block")["parameters"]
    assert parameters.get("export", "filesystem") == "filesystem"
    assert "csi.storage.k8s.io/fstype" not in parameters
    assert not VHOST_ONLY & set(parameters)


def test_snapshot_class(base: list[Obj]) -> None:
    vsc = one(base, "VolumeSnapshotClass", "csi-qsd-snapclass")
    assert vsc["driver"] == DRIVER_NAME
    assert vsc["deletionPolicy"] in ("Delete", "Retain")


def test_driver_name_everywhere(base: list[Obj]) -> None:
    names = {one(base, "CSIDriver")["metadata"]["name"]}
    names |= {sc["provisioner"] for sc in select(base, "StorageClass")}
    names |= {vsc["driver"] for vsc in select(base, "VolumeSnapshotClass")}
    pod = one(base, "DaemonSet")["spec"]["template"]["spec"]
    args = container(pod, "csi-qsd")["args"]
    names |= {arg.split("=", 1)[1] for arg in args if arg.startswith("--driver-name=")}
    assert names == {DRIVER_NAME}


# ---------------------------------------------------------------------------
# The driver image: tag in one place.

IMAGE_WITH_TAG = re.compile(re.escape(DRIVER_IMAGE) + r"[:@]")


def _deploy_yaml_files() -> list[str]:
    return sorted(
        str(path.relative_to(DEPLOY_DIR))
        for path in DEPLOY_DIR.rglob("*")
        if path.suffix in (".yaml", ".yml") or path.name == "Kustomization"
    )


def test_image_tag_is_set_in_one_place() -> None:
    tagged = [name for name in _deploy_yaml_files() if IMAGE_WITH_TAG.search((DEPLOY_DIR / name).read_text())]
    assert not tagged, f"{DRIVER_IMAGE} carries a tag in {tagged}; set it in kustomization.yaml images"
    holders = [name for name in _deploy_yaml_files() if DRIVER_VERSION in (DEPLOY_DIR / name).read_text()]
    # deploy/snapshot-metadata/ is applied on its own, so it repeats the rule; both must agree.
    assert holders == ["kustomization.yaml", "snapshot-metadata/kustomization.yaml"]
    for holder in holders:
        kustomization = yaml.safe_load((DEPLOY_DIR / holder).read_text())
        rules = [rule for rule in kustomization["images"] if rule["name"] == DRIVER_IMAGE]
        assert rules == [{"name": DRIVER_IMAGE, "newTag": DRIVER_VERSION}], holder


def test_rendered_driver_image(base: list[Obj]) -> None:
    pod = one(base, "DaemonSet")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] if c["image"].startswith(DRIVER_IMAGE)}
    assert images == {f"{DRIVER_IMAGE}:{DRIVER_VERSION}"}
    assert {c["name"] for c in pod["containers"] if c["image"].startswith(DRIVER_IMAGE)} == {"csi-qsd", "qsd"}


def test_image_tag_is_the_package_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == DRIVER_VERSION


# ---------------------------------------------------------------------------
# RBAC: what each sidecar needs, per its upstream rbac.yaml.

Need = tuple[str, str, frozenset[str], bool]  # apiGroup, resource, verbs, namespaced


def _need(group: str, resource: str, verbs: str, namespaced: bool = False) -> Need:
    return (group, resource, frozenset(verbs.split()), namespaced)


NEEDS: dict[str, list[Need]] = {
    "csi-provisioner": [
        _need("", "persistentvolumes", "get list watch create delete patch"),
        _need("", "persistentvolumeclaims", "get list watch update"),
        _need("storage.k8s.io", "storageclasses", "get list watch"),
        _need("", "events", "create patch"),
        _need("storage.k8s.io", "csinodes", "get list watch"),
        _need("", "nodes", "get list watch"),
        _need("snapshot.storage.k8s.io", "volumesnapshots", "get list"),
        _need("snapshot.storage.k8s.io", "volumesnapshotcontents", "get list"),
        _need("storage.k8s.io", "csistoragecapacities", "get list watch create update patch delete", True),
        _need("", "pods", "get", True),
        _need("apps", "daemonsets", "get", True),
    ],
    "csi-snapshotter": [
        _need("", "events", "create patch"),
        _need("snapshot.storage.k8s.io", "volumesnapshotclasses", "get list watch"),
        _need("snapshot.storage.k8s.io", "volumesnapshotcontents", "get list watch update patch"),
        _need("snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update patch"),
    ],
    # The plugin itself, after a rebuild cut pods off a volume (csi_qsd.csi.heal_pods): in every namespace.
    "csi-qsd": [
        _need("", "pods", "list delete"),
        _need("", "persistentvolumeclaims", "get"),
        _need("", "events", "create"),
    ],
    "csi-resizer": [
        _need("", "persistentvolumes", "get list watch patch"),
        _need("", "persistentvolumeclaims", "get list watch"),
        _need("", "persistentvolumeclaims/status", "patch"),
        _need("", "events", "create patch"),
        _need("coordination.k8s.io", "leases", "get watch list delete update create", True),
    ],
}


# The roles that belong to each sidecar (the pod's ServiceAccount is shared,
# so each sidecar's roles must be complete by themselves).
ROLE_PREFIX = {
    "csi-provisioner": "csi-qsd-provisioner",
    "csi-snapshotter": "csi-qsd-snapshotter",
    "csi-resizer": "csi-qsd-resizer",
    "csi-qsd": "csi-qsd-node-heal",
}


def granted(
    base: list[Obj], account: str, namespace: str, role_prefix: str
) -> list[tuple[str, str, frozenset[str], bool]]:
    """(apiGroup, resource, verbs, namespace-only) for every rule of the sidecar's roles bound to the ServiceAccount."""
    subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    result = []
    for binding in select(base, "ClusterRoleBinding") + select(base, "RoleBinding"):
        if subject not in binding["subjects"]:
            continue
        if not re.fullmatch(re.escape(role_prefix) + r"(-cfg)?", binding["roleRef"]["name"]):
            continue
        ref = binding["roleRef"]
        role = one(base, ref["kind"], ref["name"])
        if ref["kind"] == "Role":
            assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
        namespaced = binding["kind"] == "RoleBinding"
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    result.append((group, resource, frozenset(rule["verbs"]), namespaced))
    return result


@pytest.mark.parametrize("sidecar", sorted(NEEDS))
def test_rbac_covers_sidecar(base: list[Obj], sidecar: str) -> None:
    pod = one(base, "DaemonSet")["spec"]["template"]["spec"]
    container(pod, sidecar)
    account = pod["serviceAccountName"]
    one(base, "ServiceAccount", account)
    rules = granted(base, account, NAMESPACE, ROLE_PREFIX[sidecar])
    for group, resource, verbs, namespaced in NEEDS[sidecar]:
        have: set[str] = set()
        for r_group, r_resource, r_verbs, r_namespaced in rules:
            if r_group == group and r_resource == resource and (namespaced or not r_namespaced):
                have |= r_verbs
        assert verbs <= have, f"{sidecar} needs {sorted(verbs - have)} on {group or 'core'}/{resource}"


def test_rbac_grants_no_wildcards_or_secrets(base: list[Obj]) -> None:
    for role in select(base, "ClusterRole") + select(base, "Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], role["metadata"]["name"]
            assert "secrets" not in rule["resources"], "no StorageClass uses secrets"


def test_bindings_point_at_existing_roles(base: list[Obj]) -> None:
    for binding in select(base, "ClusterRoleBinding") + select(base, "RoleBinding"):
        one(base, binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for subject in binding["subjects"]:
            account = one(base, "ServiceAccount", subject["name"])
            assert account["metadata"]["namespace"] == subject["namespace"]
