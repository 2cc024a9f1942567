"""Where volume bytes live: one module per pool kind behind `base.Pool`.

A file pool keeps a qcow2 or raw file per volume; a device pool carves one
block device (local, NVMe through QSD, or a remote target through QEMU's
drivers) into regions (`regions`). A new kind is a new module here.

May import: errors, validate, sys, qcow2, params, catalog, pool_specs, qsd.
"""
