"""How the driver's processes reach each other and the cluster: TLS, UNIX sockets, the copy peers, the Kubernetes API.

`tls` holds the mutual-TLS credentials (reloaded when renewed) and who a
caller is; `unix_socket` serves a gRPC server on a UNIX socket only its
callers may reach; `copy_peers` is the caller's side of the node-to-node
copy calls (the `CopyPeers` a copy's target asks), with the peers named by
`--peer` or found in the API by `copy_peer_pods`; `kube_api` is the
Kubernetes API as a pod reaches it. The services themselves, what a call
does, are the gRPC layer's (`csi_qsd.csi`).

May import: errors, validate, sys, copy_terms, config.
"""
