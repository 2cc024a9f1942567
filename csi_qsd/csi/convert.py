"""Translate CSI messages into domain values, validating as it goes."""

from __future__ import annotations

from pathlib import Path

from csi_qsd import validate
from csi_qsd.config import TOPOLOGY_KEY_NODE, Config
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.errors import InvalidArgument
from csi_qsd.params import AccessMode, Capability

_MODES = {value: AccessMode[name] for name, value in pb.VolumeCapability.AccessMode.Mode.items()}


def capability(cap: pb.VolumeCapability, field: str = "volume_capability") -> Capability:
    """The domain's view of a capability whose REQUIRED parts `csi.required` has checked.

    Raises InvalidArgument for an access mode this spec version does not
    define, and for malformed or forbidden mount flags.
    """
    kind = cap.WhichOneof("access_type")
    mode = _MODES.get(cap.access_mode.mode, AccessMode.UNKNOWN)
    if mode is AccessMode.UNKNOWN:
        raise InvalidArgument(f"{field} has an unknown access_mode {cap.access_mode.mode}")
    if kind == "mount":
        validate.mount_flags(list(cap.mount.mount_flags))
        return Capability(block=False, fs_type=cap.mount.fs_type, mode=mode)
    return Capability(block=True, fs_type="", mode=mode)


def capabilities(caps: list[pb.VolumeCapability]) -> list[Capability]:
    return [capability(cap, f"volume_capabilities[{i}]") for i, cap in enumerate(caps)]


def request_path(value: str, field: str, config: Config) -> Path:
    return validate.request_path(
        value, field, root=config.target_root, forbidden=(config.state_dir, config.pool),
    )


def mount_group(value: str) -> str:
    # isascii: str.isdigit() also accepts '²' or '٣', which int() then refuses or reads otherwise.
    if value and not (value.isascii() and value.isdigit() and len(value) <= 10 and int(value) <= 0xFFFFFFFE):
        raise InvalidArgument(f"volume_mount_group {value!r} must be a numeric group ID")
    return value


def topology_allows(config: Config, topologies: list[pb.Topology]) -> bool:
    """True if any of `topologies` names this node (or names no node at all)."""
    for topology in topologies:
        node = topology.segments.get(TOPOLOGY_KEY_NODE)
        if node is None or node == config.node_id:
            return True
    return False
