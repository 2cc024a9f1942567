"""Per-key locks: a second call gets ABORTED; the rebuild waits for a key, with a limit."""

from __future__ import annotations

import asyncio

import pytest

from csi_qsd.errors import Aborted
from csi_qsd.sys.locks import KeyedLocks


async def test_second_holder_is_aborted_and_names_the_key() -> None:
    locks = KeyedLocks("volume")
    async with locks.hold("vol-1"):
        with pytest.raises(Aborted, match="vol-1"):
            async with locks.hold("vol-1"):
                pass
        async with locks.hold("vol-2"):  # other keys are independent
            assert locks.busy("vol-2")
    assert not locks.busy("vol-1")


async def test_wait_hold_gets_the_key_once_released() -> None:
    locks = KeyedLocks("volume")
    order: list[str] = []

    async def first() -> None:
        async with locks.hold("v"):
            await asyncio.sleep(0.05)
            order.append("first done")

    task = asyncio.create_task(first())
    await asyncio.sleep(0)
    async with locks.wait_hold("v", timeout=5) as held:
        assert held and locks.busy("v")
        order.append("waiter in")
    await task
    assert order == ["first done", "waiter in"]


async def test_wait_hold_gives_up_after_its_timeout() -> None:
    locks = KeyedLocks("volume")
    async with locks.hold("v"):
        async with locks.wait_hold("v", timeout=0.05) as held:
            assert held is False
        assert locks.busy("v"), "a waiter that gave up must not release someone else's key"
