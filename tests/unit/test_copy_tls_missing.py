"""A node whose metadata TLS Secret is not there yet still starts; a copy that needs the files says which is missing.

Found in a real cluster: deploy/node.yaml mounts the Secret as optional, so the driver's first start
sees an empty directory, and the QSD start crashed on the missing CA file (CrashLoopBackOff).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from csi_qsd.copy_terms import CopySettings
from csi_qsd.errors import Unavailable
from csi_qsd.node.copy_fill import CopyFill
from csi_qsd.qsd.client import QSDClient


class _NoQSD:
    """Fails the test if prepare reaches QSD when it has nothing to give it."""

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("prepare spoke to QSD without the TLS files")


def _streams(tmp_path: Path) -> CopyFill:
    tls_dir = tmp_path / "metadata-tls"  # the optional Secret's mount point, still empty
    tls_dir.mkdir()
    settings = CopySettings(state_dir=tmp_path / "state",
                            tls=(tls_dir / "tls.crt", tls_dir / "tls.key", tls_dir / "ca.crt"))
    return CopyFill(cast(Any, None), cast(Any, None), cast(Any, None), cast(Any, None), settings)


async def test_qsd_start_goes_on_without_the_tls_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    await _streams(tmp_path).prepare(cast(QSDClient, _NoQSD()))
    assert "event=copy_tls_missing" in caplog.text and "ca.crt" in caplog.text


async def test_a_copy_that_needs_them_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="ca.crt"):
        await _streams(tmp_path).prepare(cast(QSDClient, _NoQSD()), required=True)
