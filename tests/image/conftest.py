"""The image tests build the container image and run it: root, podman, buildah and mmdebstrap."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRED_TOOLS = ("podman", "buildah", "mmdebstrap", "unshare", "nsenter", "chroot", "losetup")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "image: builds the container image with podman and runs it; needs root, podman, buildah, "
        "mmdebstrap, FUSE and loop devices",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/image/" in str(item.fspath):
            item.add_marker(pytest.mark.image)


@pytest.fixture(scope="session", autouse=True)
def _prerequisites() -> None:
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing or os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.fail(f"image tests need root, /dev/fuse and {missing}; run scripts/install.sh")
