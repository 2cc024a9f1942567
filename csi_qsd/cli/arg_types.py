"""Flag value parsers: each turns a flag's text into its value, or an argparse error saying what is wrong."""

from __future__ import annotations

import argparse

from csi_qsd.config import POLL_MAX_NS_RANGE, parse_remote_pool
from csi_qsd.params import parse_size
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pool_specs.managed_spec import ManagedPoolSpec
from csi_qsd.pool_specs.remote_spec import RemotePoolSpec
from csi_qsd.qsd import iothreads, shards
from csi_qsd.router.config import NodeAddress


def iothread_count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number of iothreads, got {text!r}")
    try:
        return iothreads.check_size(int(text), iothreads.node_cores())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard_count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number of QSD shards, got {text!r}")
    try:
        shards.check_count(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return int(text)


def poll_max_ns(text: str) -> int | None:
    if text == "":
        return None
    if not (text.isascii() and text.isdigit() and int(text) in POLL_MAX_NS_RANGE):
        raise argparse.ArgumentTypeError(f"expected nanoseconds 0..{POLL_MAX_NS_RANGE.stop - 1}, got {text!r}")
    return int(text)


def seconds_or_never(text: str) -> float:
    """Seconds, 0 for never."""
    return 0.0 if text.strip() in ("0", "0.0") else seconds(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def device_pool(text: str) -> DevicePoolSpec:
    try:
        return DevicePoolSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def managed_pool(text: str) -> ManagedPoolSpec | None:
    if not text:
        return None
    try:
        return ManagedPoolSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def remote_pool(text: str) -> RemotePoolSpec:
    try:
        return parse_remote_pool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None




def node_address(text: str) -> NodeAddress:
    try:
        return NodeAddress.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_range(text: str) -> range:
    low, dash, high = text.partition("-")
    try:
        ports = range(int(low), int(high if dash else low) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH ports") from None
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH ports within 1-65535")
    return ports


def count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes, or a number with Ki, Mi, Gi or Ti, got {text!r}") from None


def param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value
