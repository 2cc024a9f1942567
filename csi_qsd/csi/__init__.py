"""The thin gRPC layer: validate a request, call the domain, build the response.

gRPC message types never leave this package (with `csi_pb`, the generated
messages); domain errors are mapped to status codes in exactly one place,
`errors.rpc`. `client` is the same protocol from the caller's side, for
people and tools, and `present` shows its answers to people (tables) and
scripts (JSON lines); `tls` and `metadata_listener` serve the router.

May import: errors, validate, sys, qcow2, params, catalog, qsd, pools, publish, exports, copy_link, controller, node, config.
"""
