"""Shared lookups over rendered manifests."""

from __future__ import annotations

import posixpath
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
EXAMPLES_DIR = DEPLOY_DIR / "examples"
SNAPSHOT_METADATA_DIR = DEPLOY_DIR / "snapshot-metadata"
CERT_MANAGER_DIR = SNAPSHOT_METADATA_DIR / "cert-manager"
SNAPSHOT_METADATA_SERVICE = SNAPSHOT_METADATA_DIR / "snapshotmetadataservice.yaml"

DRIVER_NAME = "csi-qsd.io"
NAMESPACE = "csi-qsd"
DRIVER_IMAGE = "ghcr.io/csi-qsd/csi-qsd"
DRIVER_VERSION = "0.1.0"
SOCKET_NAME = "vhost-user-blk.sock"

# The StorageClass parameters the driver accepts, with their allowed values
# (a set of values or a pattern).
PARAMETERS: dict[str, set[str] | re.Pattern[str]] = {
    "format": {"qcow2", "raw"},
    "preallocation": {"off", "metadata", "falloc", "full"},
    "export": {"filesystem", "vhost-user-blk"},
    "csi.storage.k8s.io/fstype": {"ext4", "xfs"},
    "numQueues": re.compile(r"[1-9][0-9]*"),
    "logicalBlockSize": {"512", "4096"},
    "cache": {"writethrough", "writeback"},
    "discard": {"unmap", "ignore"},
    "detectZeroes": {"off", "on", "unmap"},
}

Obj = dict[str, Any]


def select(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = select(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: Obj, name: str) -> Obj:
    matches = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"expected one container {name!r}, found {len(matches)}"
    found: Obj = matches[0]
    return found


def flag_values(args: list[str], flag: str) -> list[str]:
    """Values of `flag` in `args`, given as --flag=value or --flag value."""
    values: list[str] = []
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == flag and index + 1 < len(args) and not args[index + 1].startswith("-"):
            values.append(args[index + 1])
    return values


def flag_value(args: list[str], flag: str) -> str:
    values = flag_values(args, flag)
    assert len(values) == 1, f"expected {flag} exactly once in {args}, found {values}"
    return values[0]


def has_switch(args: list[str], flag: str) -> bool:
    """True if a boolean flag is set (--flag or --flag=true)."""
    return flag in args or f"{flag}=true" in args


def env_names(spec: Obj) -> set[str]:
    return {item["name"] for item in spec.get("env") or []}


def env_entry(spec: Obj, name: str) -> Obj:
    matches = [item for item in spec.get("env") or [] if item["name"] == name]
    assert len(matches) == 1, f"expected env {name} once in container {spec['name']}"
    found: Obj = matches[0]
    return found


def field_ref(spec: Obj, name: str) -> str | None:
    value_from = env_entry(spec, name).get("valueFrom") or {}
    return (value_from.get("fieldRef") or {}).get("fieldPath")


VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolve_mount(pod_spec: Obj, spec: Obj, path: str) -> tuple[Obj, Obj, str]:
    """(volumeMount, volume, path relative to the mount) for `path` inside container `spec`."""
    path = posixpath.normpath(path)
    best: Obj | None = None
    for mount in spec.get("volumeMounts") or []:
        mount_path = posixpath.normpath(mount["mountPath"])
        if path == mount_path or path.startswith(mount_path.rstrip("/") + "/"):
            if best is None or len(mount_path) > len(posixpath.normpath(best["mountPath"])):
                best = mount
    assert best is not None, f"{path} is on no volume of container {spec['name']}"
    volumes = [v for v in pod_spec.get("volumes") or [] if v["name"] == best["name"]]
    assert len(volumes) == 1, f"volume {best['name']} is not defined once"
    relative = posixpath.relpath(path, posixpath.normpath(best["mountPath"]))
    return best, volumes[0], relative


def host_path_of(pod_spec: Obj, spec: Obj, path: str) -> str:
    """The host path that `path` inside container `spec` is (its volume must be a hostPath)."""
    _, volume, relative = resolve_mount(pod_spec, spec, path)
    assert "hostPath" in volume, f"{path} in {spec['name']} is on volume {volume['name']}, not a hostPath"
    return posixpath.normpath(posixpath.join(volume["hostPath"]["path"], relative))


def unix_path(endpoint: str) -> str:
    assert endpoint.startswith("unix://"), f"{endpoint} is not a unix:// endpoint"
    path = endpoint[len("unix://") :]
    assert path.startswith("/"), f"{endpoint} is not an absolute unix:// endpoint"
    return path


def pod_specs(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(object, pod spec) for every Pod and workload with a pod template."""
    result: list[tuple[Obj, Obj]] = []
    for obj in objects:
        if obj["kind"] == "Pod":
            result.append((obj, obj["spec"]))
        elif obj["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"):
            result.append((obj, obj["spec"]["template"]["spec"]))
    return result


def pvc_claims(pod_spec: Obj) -> dict[str, str]:
    """volume name -> claim name for the pod's PVC volumes."""
    return {
        volume["name"]: volume["persistentVolumeClaim"]["claimName"]
        for volume in pod_spec.get("volumes") or []
        if "persistentVolumeClaim" in volume
    }


def qemu_options(command: str) -> dict[str, list[str]]:
    """The options of the `qemu-system-x86_64` call in a shell command: option -> its values, in order."""
    words = shlex.split(command)
    start = words.index("qemu-system-x86_64")
    options: dict[str, list[str]] = {}
    index = start + 1
    while index < len(words):
        word = words[index]
        assert word.startswith("-"), f"unexpected QEMU argument {word!r}"
        value = words[index + 1] if index + 1 < len(words) and not words[index + 1].startswith("-") else ""
        options.setdefault(word, []).append(value)
        index += 2 if value else 1
    return options


def properties(value: str) -> tuple[str, dict[str, str]]:
    """`backend,key=value,flag` -> ("backend", {"key": "value", "flag": ""})."""
    head, *rest = value.split(",")
    props: dict[str, str] = {}
    for item in rest:
        key, _, val = item.partition("=")
        props[key] = val
    return head, props


def readme_overlay(readme: Path, name: str, overlay: Path, into: Path) -> Path:
    """`into`, holding the example overlay `name`/kustomization.yaml that `readme` gives, with its one resource
    (which must be `../deploy/overlays/<overlay's name>`) pointed at `overlay` itself."""
    block = re.search(rf"```yaml\n# {re.escape(name)}/kustomization.yaml\n(.*?)```", readme.read_text(), re.S)
    assert block is not None, f"{readme}'s example overlay {name}"
    kustomization = yaml.safe_load(block.group(1))
    assert kustomization["resources"] == [f"../deploy/overlays/{overlay.name}"]
    kustomization["resources"] = [str(overlay)]
    (into / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return into
