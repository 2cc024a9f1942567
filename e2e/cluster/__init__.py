"""The cluster tier's tests: csi-qsd deployed in a real Kubernetes cluster (the harness is `testing.cluster`)."""
