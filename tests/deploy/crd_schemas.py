"""Minimal JSON schemas for the custom resources in deploy/.

kubernetes-validate ships schemas for built-in kinds only, and no package on
PyPI ships the snapshot.storage.k8s.io or kubevirt.io CRD schemas. These are
hand-written subsets of the upstream CRDs (external-snapshotter
client/config/crd, KubeVirt's VirtualMachine v1 API): they require what the
upstream schemas require, check the types and enumerations of the fields
deploy/ uses, and reject every field they do not list, so a typo fails. A
new field used in deploy/ has to be added here, checked against upstream.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
_NAME: Schema = {
    "type": "string",
    "minLength": 1,
    "maxLength": 253,
    "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
}
_METADATA: Schema = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _NAME,
        "namespace": _NAME,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    "additionalProperties": False,
}


def _top(api_version: str, kind: str, extra: dict[str, Schema], required: list[str]) -> Schema:
    properties: dict[str, Schema] = {
        "apiVersion": {"const": api_version},
        "kind": {"const": kind},
        "metadata": _METADATA,
    }
    properties.update(extra)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", *required],
        "properties": properties,
        "additionalProperties": False,
    }


VOLUME_SNAPSHOT_CLASS = _top(
    "snapshot.storage.k8s.io/v1",
    "VolumeSnapshotClass",
    {
        "driver": {"type": "string", "minLength": 1},
        "deletionPolicy": {"enum": ["Delete", "Retain"]},
        "parameters": _STRING_MAP,
    },
    ["driver", "deletionPolicy"],
)

VOLUME_SNAPSHOT = _top(
    "snapshot.storage.k8s.io/v1",
    "VolumeSnapshot",
    {
        "spec": {
            "type": "object",
            "required": ["source"],
            "properties": {
                "volumeSnapshotClassName": _NAME,
                "source": {
                    "type": "object",
                    "properties": {
                        "persistentVolumeClaimName": _NAME,
                        "volumeSnapshotContentName": _NAME,
                    },
                    "additionalProperties": False,
                    # Upstream: exactly one of the two, and immutable.
                    "oneOf": [
                        {"required": ["persistentVolumeClaimName"]},
                        {"required": ["volumeSnapshotContentName"]},
                    ],
                },
            },
            "additionalProperties": False,
        },
    },
    ["spec"],
)

_QUANTITY: Schema = {
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[mkMGTPE]|e[0-9]+)?$"},
    ]
}

_KUBEVIRT_VOLUME_SOURCES: dict[str, Schema] = {
    "containerDisk": {
        "type": "object",
        "required": ["image"],
        "properties": {
            "image": {"type": "string", "minLength": 1},
            "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            "path": {"type": "string"},
        },
        "additionalProperties": False,
    },
    "cloudInitNoCloud": {
        "type": "object",
        "properties": {
            "userData": {"type": "string"},
            "userDataBase64": {"type": "string"},
            "networkData": {"type": "string"},
        },
        "additionalProperties": False,
        "minProperties": 1,
    },
    "persistentVolumeClaim": {
        "type": "object",
        "required": ["claimName"],
        "properties": {
            "claimName": _NAME,
            "readOnly": {"type": "boolean"},
            "hotpluggable": {"type": "boolean"},
        },
        "additionalProperties": False,
    },
    "dataVolume": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": _NAME, "hotpluggable": {"type": "boolean"}},
        "additionalProperties": False,
    },
}

_KUBEVIRT_VOLUME: Schema = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}, **_KUBEVIRT_VOLUME_SOURCES},
    "additionalProperties": False,
    # A volume has exactly one source.
    "oneOf": [{"required": [source]} for source in _KUBEVIRT_VOLUME_SOURCES],
}

_KUBEVIRT_DISK: Schema = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "disk": {
            "type": "object",
            "properties": {"bus": {"enum": ["virtio", "sata", "scsi", "usb"]}},
            "additionalProperties": False,
        },
        "bootOrder": {"type": "integer", "minimum": 1},
        "serial": {"type": "string"},
    },
    "additionalProperties": False,
}

VIRTUAL_MACHINE = _top(
    "kubevirt.io/v1",
    "VirtualMachine",
    {
        "spec": {
            "type": "object",
            "required": ["template"],
            "properties": {
                "runStrategy": {"enum": ["Always", "RerunOnFailure", "Manual", "Halted", "Once"]},
                "running": {"type": "boolean"},
                "template": {
                    "type": "object",
                    "required": ["spec"],
                    "properties": {
                        "metadata": {
                            "type": "object",
                            "properties": {"labels": _STRING_MAP, "annotations": _STRING_MAP},
                            "additionalProperties": False,
                        },
                        "spec": {
                            "type": "object",
                            "required": ["domain"],
                            "properties": {
                                "domain": {
                                    "type": "object",
                                    "required": ["devices"],
                                    "properties": {
                                        "cpu": {
                                            "type": "object",
                                            "properties": {
                                                "cores": {"type": "integer", "minimum": 1},
                                                "sockets": {"type": "integer", "minimum": 1},
                                                "threads": {"type": "integer", "minimum": 1},
                                            },
                                            "additionalProperties": False,
                                        },
                                        "memory": {
                                            "type": "object",
                                            "properties": {"guest": _QUANTITY},
                                            "additionalProperties": False,
                                        },
                                        "resources": {
                                            "type": "object",
                                            "properties": {
                                                "requests": {"type": "object", "additionalProperties": _QUANTITY},
                                                "limits": {"type": "object", "additionalProperties": _QUANTITY},
                                            },
                                            "additionalProperties": False,
                                        },
                                        "devices": {
                                            "type": "object",
                                            "properties": {
                                                "disks": {"type": "array", "items": _KUBEVIRT_DISK},
                                            },
                                            "additionalProperties": False,
                                        },
                                    },
                                    "additionalProperties": False,
                                },
                                "volumes": {"type": "array", "items": _KUBEVIRT_VOLUME},
                                "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
                            },
                            "additionalProperties": False,
                        },
                    },
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
            # `running` is deprecated and may not be combined with runStrategy.
            "not": {"required": ["running", "runStrategy"]},
        },
    },
    ["spec"],
)

SCHEMAS: dict[tuple[str, str], Schema] = {
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): VOLUME_SNAPSHOT_CLASS,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshot"): VOLUME_SNAPSHOT,
    ("kubevirt.io/v1", "VirtualMachine"): VIRTUAL_MACHINE,
}
