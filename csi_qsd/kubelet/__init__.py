"""What kubelet needs next to the driver: plugin registration and a liveness endpoint, without upstream sidecars.

`csi-qsd kubelet-registrar` (`registrar`) stands in for the CSI
node-driver-registrar: it learns the driver's name over CSI and serves
kubelet's plugin registration API on a socket in kubelet's plugins_registry.
`csi-qsd liveness-probe` (`liveness`) stands in for livenessprobe: /healthz
answers whether the driver's Identity Probe does. Both take the upstream
sidecars' flags (`flags`), so the node pod's container args stay as they
are, and both reach the driver only through its CSI socket (`identity`),
like any other sidecar: never through its internals or its state dir.

May import: errors, sys, csi.
"""
