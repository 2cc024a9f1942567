"""Per-volume figures from QSD, keyed by volume ID, for the metrics collector.

Joins `query-block-exports` (which node each of our exports serves) with
`query-blockstats` here, so the collector sees neither QMP payloads nor our
node-name scheme.
"""

from __future__ import annotations

from csi_qsd.qsd import graph
from csi_qsd.qsd.client import NodeStats, QSDClient
from csi_qsd.qsd.view import BlockExportInfo


def top_node_stats(exports: dict[str, BlockExportInfo], stats: dict[str, NodeStats]) -> dict[str, NodeStats]:
    """Volume ID → figures of the node its export serves (the volume's top), for our exports only."""
    found: dict[str, NodeStats] = {}
    for export_id, export in exports.items():
        volume_id = graph.volume_of(export_id)
        node = stats.get(export["node_name"])
        if volume_id is not None and node is not None:
            found[volume_id] = node
    return found


async def volume_top_stats(client: QSDClient) -> dict[str, NodeStats]:
    """Figures of each exported volume's top node. Raises QSDError if QSD cannot be asked."""
    return top_node_stats(await client.exports(), await client.blockstats())
