"""Catalog records made up for tests: each differs from the next by a number, so rows are told apart at a glance."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from csi_qsd.catalog import VolumeRecord, VolumeState
from csi_qsd.params import VolumeParameters

MIB = 1 << 20


def volume(n: int, state: VolumeState = VolumeState.READY, **changes: object) -> VolumeRecord:
    """Volume `n`: ID vol-<n in hex>, name pvc-<n>, n MiB, default parameters, an image under /pool; `changes` on top."""
    volume_id = f"vol-{n:024x}"
    record = VolumeRecord(
        id=volume_id, name=f"pvc-{n}", capacity=n * MIB, params=VolumeParameters(),
        image=Path(f"/pool/{volume_id}.qcow2"), state=state, created_at=1700000000.25 + n,
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]
