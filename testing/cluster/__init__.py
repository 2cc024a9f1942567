"""The cluster tier's harness: a Kubernetes cluster built from source, started on this machine, csi-qsd deployed.

`build` builds (or finds in the cache) Kubernetes, etcd, the CSI sidecars,
Helm and the images; `cluster`, `kubelet_node`, `pki` and `namespace` start
the control plane and the nodes in namespaces of their own; `deploy` applies
the driver (`overlay/` over deploy/) and waits for it; `session` and `up`
give one cluster to the tests or to `scripts/cluster.sh`
(`python -m testing.cluster.up`). The tests themselves are in `e2e/cluster/`.
"""
