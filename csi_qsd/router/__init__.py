"""The snapshot-metadata router: one CSI SnapshotMetadata endpoint for a cluster whose snapshots live on nodes.

Kubernetes' external-snapshot-metadata sidecar talks to one CSI endpoint per
driver; the router is that endpoint. It learns the node plugins' addresses
(`nodes`), finds the node that holds each snapshot by asking them
(`owners`), and streams the node's answer through to the sidecar
(`service`), over mutual TLS (`csi_qsd.transport.tls`). It holds no volume data and
no catalog.

May import: errors, validate, sys, config, transport, csi.
"""
