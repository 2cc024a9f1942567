"""The VolumeAttributesClass examples: the driver accepts their parameters, in every order of changes."""

from __future__ import annotations

import itertools

from csi_qsd.params import QoS, parse_mutable_parameters
from testing.manifests.objects import DRIVER_NAME, Obj, select


def classes(examples: list[Obj]) -> dict[str, Obj]:
    return {c["metadata"]["name"]: c for c in select(examples, "VolumeAttributesClass")}


def test_gold_silver_bronze_name_the_driver(examples: list[Obj]) -> None:
    found = classes(examples)
    assert set(found) == {"csi-qsd-gold", "csi-qsd-silver", "csi-qsd-bronze"}
    for vac in found.values():
        assert vac["apiVersion"] == "storage.k8s.io/v1" and vac["driverName"] == DRIVER_NAME


def test_every_class_is_valid_from_nothing_and_after_any_other(examples: list[Obj]) -> None:
    """A claim may be created in any class and moved to any other: each merged result must be accepted."""
    found = classes(examples)
    for vac in found.values():
        parse_mutable_parameters(vac["parameters"])
    for first, second in itertools.permutations(found.values(), 2):
        after = parse_mutable_parameters(second["parameters"], parse_mutable_parameters(first["parameters"]))
        assert after == parse_mutable_parameters(second["parameters"]), "a class must set every key the others set"
    assert parse_mutable_parameters(found["csi-qsd-gold"]["parameters"]) == QoS()  # gold: no limits


def test_claims_name_existing_classes(examples: list[Obj]) -> None:
    named = [c["spec"]["volumeAttributesClassName"] for c in select(examples, "PersistentVolumeClaim")
             if c["spec"].get("volumeAttributesClassName")]
    assert named and set(named) <= set(classes(examples))
