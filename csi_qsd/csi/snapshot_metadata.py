"""CSI SnapshotMetadata service (node plugin): allocated and changed blocks of snapshots, streamed.

Answers are VARIABLE_LENGTH: a qcow2 allocation map is a list of runs of
clusters, and a run of a thousand changed clusters is one BlockMetadata, not
a thousand; a backup tool reads each run with one request. FIXED_LENGTH
would repeat the granularity in every range and multiply the messages.
Ranges are aligned to the volume's changed-block granularity (the
StorageClass parameter `changedBlockGranularity`, 64 KiB by default: the
qcow2 cluster or subcluster) except where `starting_offset` cuts the first.
`starting_offset` resumes a stream mid-volume; `max_results` bounds the
ranges per message (0: the plugin's choice, DEFAULT_MAX_RESULTS). Every
stream carries at least one message, so the caller always learns
`volume_capacity_bytes`. The work is in `csi_qsd.controller.changed_blocks`.
"""

from __future__ import annotations

import grpc

from csi_qsd.controller.changed_blocks import BlockMap, ChangedBlocks
from csi_qsd.csi.errors import RpcObservers, rpc
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.csi_pb import csi_pb2_grpc as pb_grpc
from csi_qsd.errors import InvalidArgument
from csi_qsd.qcow2 import extents

# 4096 ranges of 2 varints each stay far below gRPC's 4 MiB message limit.
DEFAULT_MAX_RESULTS = 4096


def _max_results(value: int) -> int:
    if value < 0:
        raise InvalidArgument(f"max_results must not be negative, got {value}")
    return value or DEFAULT_MAX_RESULTS


def _ranges(page: list[extents.Extent]) -> list[pb.BlockMetadata]:
    return [pb.BlockMetadata(byte_offset=offset, size_bytes=length) for offset, length in page]


class SnapshotMetadataService(pb_grpc.SnapshotMetadataServicer):
    def __init__(self, blocks: ChangedBlocks, observers: RpcObservers | None = None) -> None:
        self.rpc_observers = observers
        self._blocks = blocks

    @rpc
    async def GetMetadataAllocated(
        self, request: pb.GetMetadataAllocatedRequest, context: grpc.aio.ServicerContext
    ) -> None:
        limit = _max_results(request.max_results)
        answer: BlockMap = await self._blocks.allocated(request.snapshot_id, request.starting_offset)
        for page in extents.pages(answer.extents, limit):
            await context.write(pb.GetMetadataAllocatedResponse(
                block_metadata_type=pb.VARIABLE_LENGTH, volume_capacity_bytes=answer.capacity,
                block_metadata=_ranges(page),
            ))

    @rpc
    async def GetMetadataDelta(
        self, request: pb.GetMetadataDeltaRequest, context: grpc.aio.ServicerContext
    ) -> None:
        limit = _max_results(request.max_results)
        answer = await self._blocks.delta(request.base_snapshot_id, request.target_snapshot_id, request.starting_offset)
        for page in extents.pages(answer.extents, limit):
            await context.write(pb.GetMetadataDeltaResponse(
                block_metadata_type=pb.VARIABLE_LENGTH, volume_capacity_bytes=answer.capacity,
                block_metadata=_ranges(page),
            ))
