"""How a foreground command is asked to stop."""

from __future__ import annotations

import asyncio
import signal


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (Ctrl-C, or kubelet stopping the container)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop
