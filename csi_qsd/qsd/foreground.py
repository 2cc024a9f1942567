"""`csi-qsd qsd-run`: the node's QSD shards in the foreground of their own container.

With one shard QSD replaces this process (exec), as it always has: the
container's restart policy brings back a QSD that dies. With several, this
process keeps them: it starts each in the foreground, starts again any that
exits (the driver sees the crash over QMP and rebuilds that shard once its
socket is back), and on SIGTERM or SIGINT stops them all and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

from csi_qsd.qsd.daemon import daemon_argv
from csi_qsd.qsd.settings import QSDSettings
from csi_qsd.sys.run import tool_env

log = logging.getLogger(__name__)

RESTART_DELAY = 1.0
STOP_TIMEOUT = 10.0


def run(shards: Sequence[QSDSettings]) -> int:
    """Run every shard's QSD until a signal; never returns for a single shard (exec)."""
    for settings in shards:
        settings.qsd_dir.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        argv = daemon_argv(shards[0], daemonize=False)
        os.execvp(argv[0], argv)
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    children = {index: _start(settings, index) for index, settings in enumerate(shards)}
    while not stopping:
        for index, child in list(children.items()):
            code = child.poll()
            if code is not None and not stopping:
                log.warning("event=qsd_exited shard=%d pid=%d code=%d; starting it again", index, child.pid, code)
                time.sleep(RESTART_DELAY)
                children[index] = _start(shards[index], index)
        time.sleep(0.2)
    for child in children.values():
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for child in children.values():
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return 0


def _start(settings: QSDSettings, index: int) -> subprocess.Popen[bytes]:
    argv = daemon_argv(settings, daemonize=False)
    child = subprocess.Popen(argv, env=tool_env(), stdin=subprocess.DEVNULL)
    log.info("event=qsd_start shard=%d pid=%d", index, child.pid)
    return child
