from __future__ import annotations

import copy

import pytest

from testing.manifests.kustomize import render
from testing.manifests.objects import CERT_MANAGER_DIR, DEPLOY_DIR, EXAMPLES_DIR, SNAPSHOT_METADATA_DIR, Obj

_CACHE: dict[str, list[Obj]] = {}


def _rendered(key: str) -> list[Obj]:
    if key not in _CACHE:
        directories = {"base": DEPLOY_DIR, "examples": EXAMPLES_DIR, "snapshot-metadata": SNAPSHOT_METADATA_DIR,
                       "cert-manager": CERT_MANAGER_DIR}
        _CACHE[key] = render(directories[key])
    return copy.deepcopy(_CACHE[key])


@pytest.fixture
def base() -> list[Obj]:
    """`kustomize build deploy/`."""
    return _rendered("base")


@pytest.fixture
def examples() -> list[Obj]:
    """`kustomize build deploy/examples/`."""
    return _rendered("examples")


@pytest.fixture
def everything(base: list[Obj], examples: list[Obj]) -> list[Obj]:
    return base + examples


@pytest.fixture
def snapshot_metadata() -> list[Obj]:
    """`kustomize build deploy/snapshot-metadata/`: the router, its sidecar, Services and RBAC."""
    return _rendered("snapshot-metadata")


@pytest.fixture
def cert_manager() -> list[Obj]:
    """`kustomize build deploy/snapshot-metadata/cert-manager/`."""
    return _rendered("cert-manager")
