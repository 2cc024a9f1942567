"""Export paths: how a volume's top image reaches a consumer on this node.

One module per kind (FUSE + loop device for containers, vhost-user-blk for
VMs), each implementing `base.ExportPath`; `export_kinds` maps a volume's
`export` parameter to its kind. The staging orchestrator holds locks, intent
rows and recovery and asks the kind for everything else.

May import: errors, validate, sys, qcow2, params, catalog, qsd, pools, publish.
"""
