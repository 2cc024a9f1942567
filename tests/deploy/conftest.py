from __future__ import annotations

import copy

import pytest

from tests.deploy.helpers import DEPLOY_DIR, EXAMPLES_DIR, Obj
from tests.deploy.kustomize import render

_CACHE: dict[str, list[Obj]] = {}


def _rendered(key: str) -> list[Obj]:
    if key not in _CACHE:
        _CACHE[key] = render(DEPLOY_DIR if key == "base" else EXAMPLES_DIR)
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
