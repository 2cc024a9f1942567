"""The node side of the domain: stage, publish, unstage; moves, QoS, and each volume's condition.

`staging.NodeVolumes` is the orchestrator (locks, intent rows, recovery);
the export kinds do the rest. `moves` relocates a staged volume in its pool,
`qos` applies I/O limits live, `condition` says whether a volume can serve.

May import: errors, validate, sys, qcow2, params, catalog, qsd, pools, publish, exports, controller.
"""
