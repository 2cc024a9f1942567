"""The controller side of the domain: volumes, snapshots and clones, their chains, changed blocks, QoS, condition.

`volumes` creates and deletes; `snapshots` cuts chains (live, through
`live`, when a volume is staged); `chains` reclaims what no one needs;
`changed_blocks` answers what a snapshot holds and what changed between two;
`qos` changes a volume's I/O limits (ControllerModifyVolume); `condition`
says where a volume is published and whether it can serve
(ControllerGetVolume, ListVolumes); `copy_leases` makes volumes from
another node's snapshot or volume and serves this node's to others (the read
leases). Nothing here knows of gRPC.

May import: errors, validate, sys, qcow2, params, catalog, qsd, pools, publish, exports, copy_link.
"""
