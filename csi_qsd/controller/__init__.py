"""The controller side of the domain: volumes, snapshots and clones, their chains, changed blocks, limits, health, copies.

`volumes` creates and deletes; `snapshots` cuts chains (live, through
`live`, when a volume is staged); `chains` reclaims what no one needs;
`changed_blocks` answers what a snapshot holds and what changed between two;
`volume_limits` changes a volume's I/O limits (ControllerModifyVolume);
`health` says where a volume is published and whether it can serve
(ControllerGetVolume, ListVolumes); the two ends of a copy across nodes are
`copy_targets` (volumes made from another node's snapshot or volume) and
`copy_sources` (the read leases that serve this node's to others). Nothing
here knows of gRPC.

May import: errors, validate, sys, qcow2, params, catalog, pool_specs, qsd, pools, publish, exports, copy_terms.
"""
