"""A small offline renderer for the kustomizations in deploy/.

`kubectl` and `kustomize` are not available where these tests run, so this
module renders a kustomization the way `kustomize build` would, for exactly
the features deploy/ uses and nothing more:

* ``resources``: YAML files (multi-document) and directories that contain
  their own kustomization.yaml, rendered recursively, in the listed order;
* ``namespace``: sets ``metadata.namespace`` on every namespaced object and on
  ServiceAccount subjects of (Cluster)RoleBindings that name no namespace.
  Like kustomize, it treats every kind it does not know to be cluster-scoped
  as namespaced (kustomize only knows built-in kinds, so it would, for
  example, put a namespace on a VolumeSnapshotClass);
* ``images``: ``name`` with ``newName`` / ``newTag`` / ``digest``, applied to
  every ``containers[].image`` and ``initContainers[].image`` anywhere in an
  object;
* ``patches``: JSON patches (RFC 6902: ``add``, ``replace``, ``remove``,
  ``test``) from ``path`` or inline ``patch``, on the objects a ``target``
  names by kind and name (and group / version when given). A strategic-merge
  patch (a mapping rather than a list of operations) is refused.

Any other key in a kustomization (patches, generators, labels, ...) raises
`UnsupportedKustomization`, so that a change to deploy/ that this renderer
cannot render faithfully fails the tests loudly instead of being ignored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")

SUPPORTED_KEYS = frozenset({"apiVersion", "kind", "resources", "namespace", "images", "patches"})

# Built-in cluster-scoped kinds (the ones kustomize's built-in schema knows).
CLUSTER_SCOPED_KINDS = frozenset(
    {
        "APIService",
        "CertificateSigningRequest",
        "ClusterRole",
        "ClusterRoleBinding",
        "ComponentStatus",
        "CSIDriver",
        "CSINode",
        "CustomResourceDefinition",
        "FlowSchema",
        "IngressClass",
        "MutatingWebhookConfiguration",
        "Namespace",
        "Node",
        "PersistentVolume",
        "PriorityClass",
        "PriorityLevelConfiguration",
        "RuntimeClass",
        "StorageClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingWebhookConfiguration",
        "VolumeAttachment",
        "VolumeAttributesClass",
    }
)

Obj = dict[str, Any]


class UnsupportedKustomization(Exception):
    """The kustomization uses a feature this renderer does not implement."""


def find_kustomization(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no kustomization file in {directory}")


def load_yaml_documents(path: Path) -> list[Obj]:
    with path.open(encoding="utf-8") as handle:
        documents = [doc for doc in yaml.safe_load_all(handle) if doc is not None]
    for doc in documents:
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            raise ValueError(f"{path}: every document must be an object with apiVersion and kind")
    return documents


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """Split ``name[:tag][@digest]`` into its parts (a registry port is not a tag)."""
    digest: str | None = None
    if "@" in image:
        image, digest = image.split("@", 1)
    tag: str | None = None
    last_slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > last_slash:
        image, tag = image[:colon], image[colon + 1 :]
    return image, tag, digest


def _apply_image_rule(image: str, rule: Obj) -> str:
    name, tag, digest = split_image(image)
    if name != rule["name"]:
        return image
    new_name = str(rule.get("newName", name))
    if "digest" in rule:
        return f"{new_name}@{rule['digest']}"
    if "newTag" in rule:
        return f"{new_name}:{rule['newTag']}"
    result = new_name
    if tag is not None:
        result += f":{tag}"
    if digest is not None:
        result += f"@{digest}"
    return result


def _walk_images(node: Any, rules: list[Obj]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    if isinstance(container, dict) and isinstance(container.get("image"), str):
                        for rule in rules:
                            container["image"] = _apply_image_rule(container["image"], rule)
            _walk_images(value, rules)
    elif isinstance(node, list):
        for item in node:
            _walk_images(item, rules)


def _set_namespace(obj: Obj, namespace: str) -> None:
    kind = obj["kind"]
    if kind not in CLUSTER_SCOPED_KINDS:
        obj.setdefault("metadata", {})["namespace"] = namespace
    if kind in ("RoleBinding", "ClusterRoleBinding"):
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                subject["namespace"] = namespace


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r} does not start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _json_patch(obj: Obj, operations: list[Obj]) -> None:
    """Apply RFC 6902 operations to `obj` in place; a path that does not resolve raises KeyError/IndexError."""
    for operation in operations:
        op, parts = operation["op"], _pointer(operation["path"])
        parent: Any = obj
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op == "test":
            here = parent[int(last)] if isinstance(parent, list) else parent[last]
            if here != operation["value"]:
                raise ValueError(f"JSON patch test failed at {operation['path']}: {here!r}")
        elif op == "add" and isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(operation["value"]))
        elif op in ("add", "replace"):
            if isinstance(parent, list):
                parent[int(last)] = copy.deepcopy(operation["value"])
            else:
                if op == "replace" and last not in parent:
                    raise KeyError(f"JSON patch replace: {operation['path']} does not exist")
                parent[last] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise UnsupportedKustomization(f"JSON patch operation {op!r}")


def _apply_patch(objects: list[Obj], entry: Obj, directory: Path, kustomization_path: Path) -> None:
    unknown = sorted(set(entry) - {"path", "patch", "target"})
    if unknown or "target" not in entry or ("path" in entry) == ("patch" in entry):
        raise UnsupportedKustomization(f"{kustomization_path}: patches need a target and one of path/patch")
    text = (directory / entry["path"]).read_text(encoding="utf-8") if "path" in entry else entry["patch"]
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise UnsupportedKustomization(f"{kustomization_path}: only JSON patches (a list of operations)")
    target = entry["target"]
    matched = [
        obj for obj in objects
        if obj["kind"] == target.get("kind") and obj["metadata"].get("name") == target.get("name")
        and ("group" not in target or obj["apiVersion"].rpartition("/")[0] == target["group"])
        and ("version" not in target or obj["apiVersion"].rpartition("/")[2] == target["version"])
    ]
    if not matched:
        raise ValueError(f"{kustomization_path}: patch target {target} matches no object")
    for obj in matched:
        _json_patch(obj, operations)


def render(directory: Path) -> list[Obj]:
    """Render the kustomization in `directory` into a list of objects."""
    directory = directory.resolve()
    kustomization_path = find_kustomization(directory)
    with kustomization_path.open(encoding="utf-8") as handle:
        kustomization = yaml.safe_load(handle) or {}
    if not isinstance(kustomization, dict):
        raise ValueError(f"{kustomization_path}: not a mapping")
    unsupported = sorted(set(kustomization) - SUPPORTED_KEYS)
    if unsupported:
        raise UnsupportedKustomization(
            f"{kustomization_path}: this renderer does not implement {', '.join(unsupported)}"
        )
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise UnsupportedKustomization(f"{kustomization_path}: kind must be Kustomization")

    objects: list[Obj] = []
    for entry in kustomization.get("resources") or []:
        if not isinstance(entry, str) or "://" in entry:
            raise UnsupportedKustomization(f"{kustomization_path}: unsupported resource {entry!r}")
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(render(path))
        elif path.is_file():
            objects.extend(copy.deepcopy(load_yaml_documents(path)))
        else:
            raise FileNotFoundError(f"{kustomization_path}: resource {entry!r} does not exist")

    for entry in kustomization.get("patches") or []:
        _apply_patch(objects, entry, directory, kustomization_path)

    namespace = kustomization.get("namespace")
    if namespace is not None:
        for obj in objects:
            _set_namespace(obj, str(namespace))

    rules = kustomization.get("images") or []
    for rule in rules:
        if "name" not in rule:
            raise ValueError(f"{kustomization_path}: an images entry has no name")
        unknown = sorted(set(rule) - {"name", "newName", "newTag", "digest"})
        if unknown:
            raise UnsupportedKustomization(f"{kustomization_path}: images keys {unknown}")
        if "newTag" in rule:
            rule["newTag"] = str(rule["newTag"])
    _walk_images(objects, rules)

    seen: set[tuple[str, str, str | None, str]] = set()
    for obj in objects:
        metadata = obj.get("metadata") or {}
        key = (obj["apiVersion"].split("/")[0], obj["kind"], metadata.get("namespace"), metadata.get("name", ""))
        if key in seen:
            raise ValueError(f"{kustomization_path}: duplicate object {key}")
        seen.add(key)
    return objects
