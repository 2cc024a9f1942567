"""The StorageClass parameter `vmmGroup`: the VMM's group owns a VM volume's socket."""

from __future__ import annotations

import pytest

from csi_qsd.errors import InvalidArgument
from csi_qsd.params import VolumeParameters, parse_parameters


def test_vmm_group_is_a_gid_kept_with_the_volume() -> None:
    params = parse_parameters({"export": "vhost-user-blk", "vmmGroup": "107"})
    assert params.vmm_group == "107"
    assert VolumeParameters.from_json(params.to_json()) == params
    assert parse_parameters({"export": "vhost-user-blk"}).vmm_group == ""
    assert VolumeParameters.from_json('{"export": "vhost-user-blk"}').vmm_group == ""  # volumes made before it


@pytest.mark.parametrize("value", ["0", "abc", "-1", "4294967295", " 107", "107 "])
def test_vmm_group_refuses_what_is_not_a_gid_other_than_root(value: str) -> None:
    with pytest.raises(InvalidArgument, match="vmmGroup"):
        parse_parameters({"export": "vhost-user-blk", "vmmGroup": value})


def test_vmm_group_applies_to_vm_volumes_only() -> None:
    with pytest.raises(InvalidArgument, match="'vmmGroup' applies only to export 'vhost-user-blk'"):
        parse_parameters({"vmmGroup": "107"})
