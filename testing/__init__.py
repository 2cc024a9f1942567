"""Test support: what `tests/` and `e2e/` both run on, and nothing that is a test.

The two test trees import from here and never from each other; this package
imports neither of them (`tests/unit/test_tree_layout.py` holds all three to
that). It is not part of the driver: the wheel ships `csi_qsd` only.

* `harness`: the driver under test in a sandbox (`Sandbox`, `DriverProcess`,
  `in_process_driver`, `until` and the QSD probes).
* `owner`, `stale_runs`, `leftovers`: what a run makes is marked as its own,
  swept when a killed run left it, and checked for afterwards.
* `tiers`, `timeouts`: what each tier needs (a failure in CI, a skip
  elsewhere) and how long each of its tests may take.
* `certs`, `router_cluster`, `remote_targets`: TLS material, several nodes
  with the snapshot-metadata router, NBD and iSCSI targets.
* `served`: the served driver of an e2e test, and VM volumes provisioned on it.
* `shared_bin`: where the CSI community's prebuilt binaries are.
* `helpers/`: helpers over real parts (device pools, writers, metrics, …).
* `manifests/`: the deploy/ manifests read and rendered as kustomize renders.
* `guest/`: a tiny Linux guest booted in QEMU, and its checked writes.
* `cluster/`: the cluster tier's Kubernetes cluster, built, started and torn down.
"""
