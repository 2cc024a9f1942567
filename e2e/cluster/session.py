"""A cluster with csi-qsd deployed, for the benches: started, used, stopped (conftest.py does it for tests)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from e2e.cluster import deploy
from e2e.cluster.build import Built
from e2e.cluster.cluster import Binaries, Cluster
from tests import owner


@contextmanager
def deployed_cluster(built: Built) -> Iterator[Cluster]:
    """A started cluster with the snapshot CRDs and controller and csi-qsd (`kubectl apply -k`); removed after."""
    base = owner.make_base("csi-qsd-bench-cluster-", Path("/var/tmp"))
    cluster = Cluster(base, Binaries(built.kubernetes))
    try:
        cluster.start(list(built.images))
        deploy.install_snapshot_support(cluster, built)
        deploy.deploy_driver(cluster)
        yield cluster
    finally:
        problems = cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
        if problems:
            print("cluster teardown left:", problems)
