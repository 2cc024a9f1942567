"""Where volume bytes live: one module per pool kind behind `base.Pool`.

A file pool keeps a qcow2 or raw file per volume; a device pool carves one
block device (local, NVMe through QSD, or a remote target through QEMU's
drivers) into regions (`regions`). Each kind is configured by a spec in
`csi_qsd.pool_specs` and opened through `pool_kinds`: a new kind is a new
module here and a line there.

May import: errors, validate, sys, qcow2, params, catalog, pool_specs, qsd.
"""
