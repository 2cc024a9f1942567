"""Shared by the e2e tests: one guest image per session, and the marks for a test whose tools are missing."""

from __future__ import annotations

import shutil

import pytest

from testing import tiers
from testing.guest import GuestImage, build_guest_image

GUEST_TOOLS = ("qemu-system-x86_64", "qemu-storage-daemon", "qemu-img", "apt-get", "dpkg-deb")


def e2e_marks(tools: tuple[str, ...] = GUEST_TOOLS) -> list[pytest.MarkDecorator]:
    """`pytestmark` for an e2e module: marked e2e; a tool it runs that is missing fails it in CI, else skips it."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    return [pytest.mark.e2e, tiers.needs("e2e", missing)]


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    return build_guest_image()
