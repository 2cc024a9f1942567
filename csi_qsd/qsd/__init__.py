"""Everything that speaks to qemu-storage-daemon; QMP JSON never leaves this package.

The supervisor (`daemon`) starts, adopts, watches and replaces one QSD;
`shards` keeps a node's QSDs (one by default, or several shards, each
under its own supervisor); `client` is a QSD's QMP session; `attach` and
`graph` build each volume's nodes and exports idempotently, `block_jobs`
merges layers and fills copies; `features`
says what a QSD release can safely do.

May import: errors, validate, sys, qcow2, params, pool_specs.
"""
