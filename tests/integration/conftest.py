"""Integration fixtures: a sandboxed driver with a real QSD, FUSE, loop devices and mounts."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.server import Driver
from testing.harness import DriverProcess, Sandbox, in_process_driver, running_driver, sandbox
from testing.helpers.nvme_pools import FakeNVMe

REQUIRED_TOOLS = ("qemu-storage-daemon", "qemu-img", "losetup", "mkfs.ext4", "mkfs.xfs", "blkid")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def _prerequisites() -> None:
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing or os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.fail(f"integration tests need root, /dev/fuse and {missing}; run scripts/install.sh")


@pytest.fixture
def box() -> Iterator[Sandbox]:
    with sandbox() as value:
        yield value


@pytest.fixture
async def driver(box: Sandbox) -> AsyncIterator[tuple[Driver, CSIClient]]:
    async with in_process_driver(box) as pair:
        yield pair


@pytest.fixture
async def csi(driver: tuple[Driver, CSIClient]) -> CSIClient:
    return driver[1]


@pytest.fixture
async def process(box: Sandbox) -> AsyncIterator[DriverProcess]:
    """The driver as a separate `csi-qsd serve` process, as in a pod."""
    async with running_driver(box) as driver:
        yield driver


@pytest.fixture
def nvme() -> Iterator[FakeNVMe]:
    """A stand-in NVMe drive (a loop device) for a device pool, detached afterwards."""
    device = FakeNVMe()
    try:
        yield device
    finally:
        device.close()
