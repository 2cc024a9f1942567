"""Minimal JSON schemas for the custom resources in deploy/.

kubernetes-validate ships schemas for built-in kinds only, and no package on
PyPI ships the snapshot.storage.k8s.io, cbt.storage.k8s.io, cert-manager.io or
kubevirt.io CRD schemas. These are
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

# kubernetes-csi/external-snapshot-metadata client/config/crd (v1alpha1): cluster-scoped, all three fields required.
SNAPSHOT_METADATA_SERVICE = _top(
    "cbt.storage.k8s.io/v1alpha1",
    "SnapshotMetadataService",
    {
        "spec": {
            "type": "object",
            "required": ["address", "audience", "caCert"],
            "properties": {
                "address": {"type": "string", "pattern": r"^[a-z0-9.-]+:[0-9]+$"},
                "audience": {"type": "string", "minLength": 1},
                "caCert": {"type": "string", "contentEncoding": "base64", "pattern": r"^[A-Za-z0-9+/]+=*$"},
            },
            "additionalProperties": False,
        },
    },
    ["spec"],
)

_ISSUER_REF: Schema = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": {"type": "string"}},
    "additionalProperties": False,
}

# cert-manager.io/v1 (cert-manager's CRDs): the fields deploy/snapshot-metadata/cert-manager uses.
CERT_MANAGER_ISSUER = _top(
    "cert-manager.io/v1",
    "Issuer",
    {
        "spec": {
            "type": "object",
            "properties": {
                "selfSigned": {"type": "object", "additionalProperties": False},
                "ca": {
                    "type": "object",
                    "required": ["secretName"],
                    "properties": {"secretName": _NAME},
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
            "oneOf": [{"required": ["selfSigned"]}, {"required": ["ca"]}],
        },
    },
    ["spec"],
)

_KEY_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement", "data encipherment",
    "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth", "client auth", "code signing",
    "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
]

CERT_MANAGER_CERTIFICATE = _top(
    "cert-manager.io/v1",
    "Certificate",
    {
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "properties": {
                "secretName": _NAME,
                "issuerRef": _ISSUER_REF,
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "isCA": {"type": "boolean"},
                "duration": {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s))+$"},
                "usages": {"type": "array", "items": {"enum": _KEY_USAGES}},
                "privateKey": {
                    "type": "object",
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
        },
    },
    ["spec"],
)

SCHEMAS: dict[tuple[str, str], Schema] = {
    ("cbt.storage.k8s.io/v1alpha1", "SnapshotMetadataService"): SNAPSHOT_METADATA_SERVICE,
    ("cert-manager.io/v1", "Issuer"): CERT_MANAGER_ISSUER,
    ("cert-manager.io/v1", "Certificate"): CERT_MANAGER_CERTIFICATE,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): VOLUME_SNAPSHOT_CLASS,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshot"): VOLUME_SNAPSHOT,
    ("kubevirt.io/v1", "VirtualMachine"): VIRTUAL_MACHINE,
}
