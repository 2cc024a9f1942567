"""Block jobs on a volume's chain: a stream that merges layers (with their changed-block records), a copy's fill.

Each job is started and watched here; the chain's nodes and exports stay as
`csi_qsd.qsd.attach` built them. QSD's own names for the nodes of an image
opened from a backing chain are found by the image's file name
(`format_node_of`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from csi_qsd.errors import QSDError
from csi_qsd.qcow2 import layer_bitmaps
from csi_qsd.qsd import features, graph
from csi_qsd.qsd.client import JOB_BY_HAND, BlockNodeInfo, QSDClient, node_info


async def stream_into_backing(
    client: QSDClient, volume_id: str, backing_image: Path, layers: list[Path] | None = None,
) -> bool:
    """Copy everything below the node that reads `backing_image` into it (block-stream); wait for the end.

    `layers`: the images below it, newest first; their changed-block
    records are carried into it first (`csi_qsd.qcow2.layer_bitmaps`), in one
    transaction. False if QSD does not have that image open. The caller
    picks an intermediate node on purpose: QSD 7.2's writable FUSE export
    holds the 'resize' permission that a stream into the top must deny.
    """
    nodes, bitmaps = await nodes_and_bitmaps(client)
    base = format_node_of(nodes, str(backing_image))
    if not base:
        return False
    if features.bitmaps_carried_before_stream(await client.version()):
        await carry_bitmaps(client, base, nodes, bitmaps, layers or [])
        await client.stream(f"stream-{volume_id}", base)
        return True
    # QEMU >= 11: the base's own record stops before the copy writes into it; the rest is carried while
    # the job holds the base read-write, before it finalizes (a crash before then leaves the chain as it was).
    own = bitmaps[base].get(layer_bitmaps.OWN)
    if own is not None and own.consistent:
        await client.execute("block-dirty-bitmap-disable", {"node": base, "name": layer_bitmaps.OWN})

    async def carry() -> None:
        await carry_bitmaps(client, base, nodes, bitmaps, layers or [], own_disabled=True)

    await client.stream(f"stream-{volume_id}", base, carry)
    return True


async def carry_bitmaps(
    client: QSDClient, target: str, nodes: dict[str, BlockNodeInfo],
    bitmaps: dict[str, dict[str, layer_bitmaps.Bitmap]], layers: list[Path], *, own_disabled: bool = False,
) -> None:
    """Before merging `layers` into node `target`: freeze its own record (unless `own_disabled` already) and
    copy theirs into it, atomically."""
    own = bitmaps[target]
    actions: list[graph.QMPArgs] = []
    if (mine := own.get(layer_bitmaps.OWN)) is not None and mine.consistent and not own_disabled:
        actions.append({"type": "block-dirty-bitmap-disable", "data": {"node": target, "name": layer_bitmaps.OWN}})
    sources = [format_node_of(nodes, str(image)) for image in layers]
    found = [(image.name, bitmaps[node] if node else {}) for image, node in zip(layers, sources)]
    for step in layer_bitmaps.plan_carry(found, set(own)):
        actions.append({"type": "block-dirty-bitmap-add", "data": {
            "node": target, "name": step.target, "granularity": step.granularity,
            "persistent": True, "disabled": True}})
        if step.source is not None:
            actions.append({"type": "block-dirty-bitmap-merge", "data": {
                "node": target, "target": step.target,
                "bitmaps": [{"node": sources[step.layer], "name": step.source}]}})
    if actions:
        await client.execute("transaction", {"actions": actions})


async def nodes_and_bitmaps(
    client: QSDClient,
) -> tuple[dict[str, BlockNodeInfo], dict[str, dict[str, layer_bitmaps.Bitmap]]]:
    """Every named node (QEMU's own '#block' names included), and the persistent bitmaps of each."""
    raw = await client.execute("query-named-block-nodes", {"flat": True})
    nodes = {item["node-name"]: node_info(item) for item in raw}
    bitmaps = {
        item["node-name"]: {
            b["name"]: layer_bitmaps.Bitmap(b["name"], int(b["granularity"]), not b.get("inconsistent", False))
            for b in item.get("dirty-bitmaps", []) if b.get("persistent")
        }
        for item in raw
    }
    return nodes, bitmaps


def format_node_of(nodes: dict[str, BlockNodeInfo], image: str) -> str:
    """The qcow2 node QSD reads `image` through, or ''.

    A node QEMU opened from a backing chain reports the image's file name; an
    overlay we attached with blockdev-snapshot reports a json: pseudo-name,
    so it is found through its file node, whose name follows our scheme. A
    layer opened with options of its own (an encrypted one, keyed) reports a
    json: pseudo-name that holds its image's file name.
    """
    for name, info in nodes.items():
        if info["drv"] == "qcow2" and image in (info["file"], _pseudo_file(info["file"])):
            return name
        candidate = graph.format_node_over(name) if info["drv"] == "file" and info["file"] == image else None
        if candidate is not None and candidate in nodes:
            return candidate
    return ""


def _pseudo_file(name: str) -> str:
    """The file name inside a node's json: pseudo-name (`json:{..., "file": {"filename": ...}}`), or ''."""
    if not name.startswith("json:"):
        return ""
    try:
        spec = json.loads(name[5:])
    except ValueError:
        return ""
    file = spec.get("file") if isinstance(spec, dict) else None
    return str(file.get("filename", "")) if isinstance(file, dict) and file.get("driver") == "file" else ""


async def start_fill(client: QSDClient, job_id: str, node: str, speed: int) -> None:
    """Start copying everything below `node` into it (block-stream, finalized by hand), at most `speed` bytes/s
    (0: no limit)."""
    await client.execute("block-stream", {"job-id": job_id, "device": node, "speed": speed, **JOB_BY_HAND})


async def cancel_job(client: QSDClient, job_id: str) -> None:
    """Cancel block job `job_id` and see it end; nothing if there is none."""
    if await client.job(job_id) is not None:
        await client.execute("job-cancel", {"id": job_id})
        with contextlib.suppress(QSDError):
            await client.finish_job(job_id)
