"""The node side of the domain: stage, publish, unstage; rebuilds and moves of staged volumes; copies filled.

`staging.Staging` is the orchestrator (locks, intent rows, recovery);
the export kinds do the rest. `rebuild` brings staged volumes back after a
QSD (re)connect, `moves` relocates a staged volume in its pool,
`copy_fill` fills the volumes copied from another node in the background.
Nothing here imports the controller side: what both sides use lives below
them (`csi_qsd.params`, `csi_qsd.pools`, `csi_qsd.copy_terms`).

May import: errors, validate, sys, qcow2, params, catalog, pool_specs, qsd, pools, publish, exports, copy_terms.
"""
