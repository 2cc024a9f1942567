"""Everything that speaks to qemu-storage-daemon; QMP JSON never leaves this package.

The supervisor (`daemon`) starts, adopts, watches and replaces the one QSD
of a node; `client` is its QMP session; `attach` and `graph` build each
volume's nodes and exports idempotently; `features` says what a QSD release
can safely do.

May import: errors, validate, sys, qcow2, params.
"""
