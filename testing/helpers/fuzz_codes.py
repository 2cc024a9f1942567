"""The codes the CSI spec allows each RPC to answer, as the fuzz test and the load bench judge them.

`ALLOWED` maps every RPC's name to its codes. A test or bench that sends
requests checks each answer against it; an answer outside it is a bug in
the driver, however malformed the request was.
"""

from __future__ import annotations

import grpc

Code = grpc.StatusCode

# Codes the spec allows per RPC. Every RPC may answer INVALID_ARGUMENT (a bad or missing field)
# and ABORTED (an operation pending on the object); on top come the codes of the RPC's own error
# table, and a few the driver adds where the spec leaves the code open ("MUST return a non-ok
# code"), each named with its reason. INTERNAL, UNKNOWN and UNAVAILABLE are never allowed here:
# no request, however malformed, may break the driver, and the fuzz run does not restart QSD (the
# load bench, which kills it, adds UNAVAILABLE itself).
_GENERAL = {Code.OK, Code.INVALID_ARGUMENT, Code.ABORTED}
_NOT_OFFERED = {Code.UNIMPLEMENTED}
ALLOWED: dict[str, set[grpc.StatusCode]] = {
    "GetPluginInfo": {Code.OK},
    "GetPluginCapabilities": {Code.OK},
    "Probe": {Code.OK, Code.FAILED_PRECONDITION},
    "CreateVolume": _GENERAL | {Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE},
    "DeleteVolume": _GENERAL | {Code.FAILED_PRECONDITION},
    "ControllerPublishVolume": _NOT_OFFERED,
    "ControllerUnpublishVolume": _NOT_OFFERED,
    "ValidateVolumeCapabilities": _GENERAL | {Code.NOT_FOUND},
    "ListVolumes": _GENERAL,
    "ControllerGetVolume": _GENERAL | {Code.NOT_FOUND},
    "ControllerModifyVolume": _GENERAL | {Code.NOT_FOUND},
    "GetCapacity": _GENERAL,
    "ControllerGetCapabilities": {Code.OK},
    # Driver additions: an unknown source volume is NOT_FOUND; a raw volume cannot be snapshotted
    # and a snapshot name in mid-creation is busy (FAILED_PRECONDITION).
    "CreateSnapshot": _GENERAL | {Code.ALREADY_EXISTS, Code.RESOURCE_EXHAUSTED, Code.NOT_FOUND,
                                  Code.FAILED_PRECONDITION},
    "DeleteSnapshot": _GENERAL | {Code.FAILED_PRECONDITION},
    "ListSnapshots": _GENERAL,
    "GetSnapshot": _GENERAL | {Code.NOT_FOUND},
    "ControllerExpandVolume": _NOT_OFFERED,
    "NodeStageVolume": _GENERAL | {Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION},
    # Driver addition: unstaging a volume still published is FAILED_PRECONDITION (the spec's
    # reference-counting rule: every NodeUnpublishVolume comes before NodeUnstageVolume).
    "NodeUnstageVolume": _GENERAL | {Code.NOT_FOUND, Code.FAILED_PRECONDITION},
    "NodePublishVolume": _GENERAL | {Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION},
    "NodeUnpublishVolume": _GENERAL | {Code.NOT_FOUND},
    "NodeGetVolumeStats": _GENERAL | {Code.NOT_FOUND},
    # Driver addition: a size the pool cannot hold is RESOURCE_EXHAUSTED, as in CreateVolume.
    "NodeExpandVolume": _GENERAL | {Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.OUT_OF_RANGE,
                                    Code.RESOURCE_EXHAUSTED},
    "NodeGetCapabilities": {Code.OK},
    "NodeGetInfo": {Code.OK},
    "GroupControllerGetCapabilities": {Code.OK},
    # Driver addition: an unknown source volume is NOT_FOUND.
    "CreateVolumeGroupSnapshot": _GENERAL | {Code.ALREADY_EXISTS, Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION,
                                             Code.NOT_FOUND},
    "DeleteVolumeGroupSnapshot": _GENERAL | {Code.FAILED_PRECONDITION},
    "GetVolumeGroupSnapshot": _GENERAL | {Code.NOT_FOUND},
}
