"""The thin gRPC layer: validate a request, call the domain, build the response.

gRPC message types never leave this package (with `csi_pb`, the generated
messages); domain errors are mapped to status codes in exactly one place,
`errors.rpc`. One module per CSI service (`identity`, `controller`,
`group_controller`, `node`, `snapshot_metadata`), and `copy_service` for
the copy calls of other nodes and of this node's operator;
`metadata_listener` serves the router and the peers over mutual TLS (the
TLS itself, the UNIX socket and the peers' side of the copy calls are
`csi_qsd.transport`'s). The caller's side of CSI, for people and tools, is
`csi_qsd.cli.client`.

May import: errors, validate, sys, qcow2, params, catalog, pool_specs, qsd, pools, publish, exports, copy_terms, controller, node, config, transport.
"""
