"""Every pool kind as configured: its flag parsed and checked, before any device, file or target is opened.

One module per way a pool is spelled: `device` (`--device-pool`, a local
block device or an NVMe controller by its `nvme_address`), `remote`
(`--remote-pool`, an iSCSI LUN or NBD export QSD's own drivers reach), and
`managed` (`--managed-pool`, the file pool's own XFS). Side by side and
below both the configuration and QSD, so each can read a spec without
importing the pool that opens it; `kind` names which opener of
`csi_qsd.pools.pool_kinds` a spec goes to.

May import: errors, params.
"""
