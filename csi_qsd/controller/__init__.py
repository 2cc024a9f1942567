"""The controller side of the domain: volumes, snapshots and clones, their chains, and changed blocks.

`volumes` creates and deletes; `snapshots` cuts chains (live, through
`live`, when a volume is staged); `chains` reclaims what no one needs;
`changed_blocks` answers what a snapshot holds and what changed between two.
Nothing here knows of gRPC.

May import: errors, validate, sys, qcow2, params, catalog, qsd, pools, publish, exports.
"""
