"""Backups for operators: snapshots to qcow2 files (full and incremental) and back, and an NBD view of one.

Driven through a served driver's CSI endpoint and the catalog, never
through its internals.

May import: errors, validate, sys, qcow2, params, catalog.
"""
