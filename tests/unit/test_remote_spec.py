"""`--remote-pool NAME=URL[,...]`: what is accepted, what is refused and why, and what QSD is asked to open."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from csi_qsd.cli import build_parser, config_from
from csi_qsd.config import Config, parse_remote_pool
from csi_qsd.pool_specs.remote_spec import OnError, RemoteTarget, Scheme
from csi_qsd.pools.remote import read_credentials
from csi_qsd.qsd.storage import RemoteDevice

IQN = "iqn.2026-01.io.example:array"


def test_urls_as_qemu_spells_them() -> None:
    assert RemoteTarget.parse(f"iscsi://10.0.0.5/{IQN}/3") == RemoteTarget(
        Scheme.ISCSI, "10.0.0.5", 3260, iqn=IQN, lun=3)
    assert RemoteTarget.parse("nbd://nas.example:10900/pool-a") == RemoteTarget(
        Scheme.NBD, "nas.example", 10900, export="pool-a")
    unix = RemoteTarget.parse("nbd+unix:///pool?socket=/run/nbd.sock")
    assert unix == RemoteTarget(Scheme.NBD_UNIX, socket=Path("/run/nbd.sock"), export="pool")
    for text in (f"iscsi://[fd00::1]:3261/{IQN}/0", "nbd://127.0.0.1:10809/pool",
                 "nbd+unix:///pool?socket=/run/nbd.sock"):
        assert str(RemoteTarget.parse(text)) == text


@pytest.mark.parametrize("text,says", [
    ("ceph://mon/pool", "unknown scheme 'ceph://'"),
    ("iscsi//host/x/1", "unknown scheme"),
    (f"iscsi://alice:s3cret@10.0.0.5/{IQN}/1", "credentials do not go in the URL"),
    (f"iscsi://10.0.0.5/{IQN}", "expected iscsi://HOST"),
    ("iscsi://10.0.0.5/not-an-iqn/1", "not an iSCSI qualified name"),
    (f"iscsi://10.0.0.5/{IQN}/99999", "LUN must be"),
    (f"iscsi://10.0.0.5:0x10/{IQN}/1", "port must be"),
    ("nbd:///pool", "no host"),
    ("nbd://host/", "export name"),
    ("nbd://bad_host!/pool", "not a host name"),
    ("nbd+unix://host/pool?socket=/s", "takes no host"),
    ("nbd+unix:///pool?socket=relative", "socket=/ABSOLUTE/PATH"),
    ("nbd+unix:///pool", "socket=/ABSOLUTE/PATH"),
])
def test_bad_urls_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as err:
        RemoteTarget.parse(text)
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("text,says", [
    ("san", "expected NAME=URL"),
    ("default=nbd://h/p", "not be 'default'"),
    ("san=nbd://h/p,bogus=1", "bad option 'bogus=1'"),
    ("san=nbd://h/p,force=yes", "bad option"),
    ("san=nbd://h/p,on-error=retry", "on-error must be"),
    ("san=nbd://h/p,tls=relative", "absolute directory"),
    (f"san=iscsi://h/{IQN}/1,tls=/etc/tls", "for NBD targets"),
    ("san=nbd://h/p,secret=/etc/chap", "for iSCSI CHAP"),
    ("san=nbd+unix:///p?socket=/s,tls=/etc/tls", "tls-name=NAME"),
    ("san=nbd://h/p,tls-name=server", "needs tls="),
    ("san=nbd://h/p", "NBD over TCP needs tls=DIR"),
    ("san=nbd://h/p,on-error=fail", "add ',insecure' to accept that"),
    ("san=nbd://h/p,tls=/etc/tls,insecure", "insecure is for NBD over TCP without tls="),
    (f"san=iscsi://h/{IQN}/1,insecure", "insecure is for NBD over TCP"),
    ("san=nbd://h/p,insecure=yes", "bad option"),
])
def test_bad_flags_name_the_flag(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as err:
        parse_remote_pool(text)
    assert str(err.value).startswith("--remote-pool")


def test_cleartext_nbd_over_tcp_only_when_the_flag_says_so() -> None:
    plain = parse_remote_pool("lab=nbd://10.0.0.7/pool,insecure")
    assert plain.insecure and plain.tls is None
    assert not parse_remote_pool("nas=nbd://10.0.0.7/pool,tls=/etc/nbd").insecure
    assert parse_remote_pool("local=nbd+unix:///pool?socket=/run/nbd.sock").tls is None  # a local socket: no network


def test_an_iscsi_pool_without_chap_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="csi_qsd.pools.remote"):
        assert read_credentials(parse_remote_pool(f"san=iscsi://10.0.0.5/{IQN}/1")) == ("", None)
    assert "event=remote_pool_unauthenticated pool=san" in caplog.text and "CHAP" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="csi_qsd.pools.remote"):
        read_credentials(parse_remote_pool("nas=nbd://10.0.0.7/pool,tls=/etc/nbd"))
    assert "remote_pool_unauthenticated" not in caplog.text


def test_serve_takes_remote_pools_from_flags_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CSI_QSD_REMOTE_POOL", "nas=nbd://10.0.0.7/pool,tls=/etc/nbd,on-error=fail")
    args = build_parser().parse_args(["serve", "--remote-pool", f"san=iscsi://10.0.0.5/{IQN}/1,secret=/etc/chap"])
    pools = config_from(args).remote_pools
    assert [(p.name, str(p.target), p.on_error) for p in pools] == [
        ("nas", "nbd://10.0.0.7:10809/pool", OnError.FAIL), ("san", f"iscsi://10.0.0.5:3260/{IQN}/1", OnError.WAIT)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--remote-pool", "x=gluster://h/v"])
    assert "--remote-pool x: 'gluster://h/v': unknown scheme" in capsys.readouterr().err
    with pytest.raises(ValueError, match="names must be unique"):
        Config(state_dir=Path("/tmp/x"), device_pools=(), remote_pools=(pools[0], pools[0]))


def test_qsd_gets_files_never_the_password(tmp_path: Path) -> None:
    device = RemoteDevice(RemoteTarget.parse(f"iscsi://10.0.0.5/{IQN}/1"), "r-san", OnError.WAIT, "alice",
                          tmp_path / "password")
    every = json.dumps([device.objects(), device.base_blockdev(), device.child(read_only=False)])
    assert "file" in device.objects()[0] and "data" not in device.objects()[0]
    assert device.base_blockdev()["password-secret"] == device.objects()[0]["id"]
    assert device.base_blockdev()["timeout"] == 0  # on-error=wait: libiscsi waits for the target
    assert "node-name" not in device.child(read_only=True) and '"alice"' in every
    nbd = RemoteDevice(RemoteTarget.parse("nbd://10.0.0.7/pool"), "r-nas", OnError.FAIL, tls_dir=tmp_path)
    assert nbd.base_blockdev()["tls-creds"] == nbd.objects()[0]["id"]
    assert nbd.objects()[0]["endpoint"] == "client" and nbd.objects()[0]["verify-peer"] is True
    assert nbd.base_blockdev()["server"] == {"type": "inet", "host": "10.0.0.7", "port": "10809"}
