"""Tests whose tools are missing: skipped outside CI, failed in CI, and listed one line a tier at the end of the run.

Every check for a tool the install provides (Go, the cluster cache's build, QEMU 11, fio, libblkio, the
prebuilt sidecars, root) goes through here, so CI (`CI=true`, which `.ci/run` exports) can never pass
with a tier silently skipped. `needs` is a mark for a module or test, decided before its fixtures run;
`require` is the same check inside a test or fixture. `opt_in` is for what no install provides (a real
NVMe controller): skipped in CI too, and still listed.

The ledger of skipped tiers is printed at the end of the pytest run and, when `CSI_QSD_SKIPPED_TIERS`
names a file, appended to it, so `scripts/test.sh` can repeat it after its last pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MARK = "tier_needs"
REPORT_FILE_ENV = "CSI_QSD_SKIPPED_TIERS"
_CI_TRUE = ("true", "1", "yes")


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """True when the run is CI's: `CI` set to true (GitHub, GitLab and this project's `.ci/run` set it so)."""
    return environ.get("CI", "").strip().lower() in _CI_TRUE


def _what(missing: Sequence[str] | str) -> str:
    return missing if isinstance(missing, str) else ", ".join(missing)


@dataclass(frozen=True)
class Verdict:
    """What to do with a test whose tier lacks something: fail it (CI) or skip it, and the message."""

    fail: bool
    message: str


def verdict(tier: str, missing: Sequence[str] | str, *, ci: bool, opt_in: bool = False) -> Verdict | None:
    """None when nothing is missing; else fail in CI (unless the tier is opt-in), skip elsewhere."""
    what = _what(missing)
    if not what:
        return None
    if ci and not opt_in:
        return Verdict(True, f"{tier} tier cannot run in CI: missing {what} (CI installs it: scripts/install.sh, README)")
    return Verdict(False, f"{tier}: {what}" if opt_in else f"{tier}: missing {what}")


@dataclass
class Ledger:
    """The tiers skipped in this run: one line each, with the reason and how many tests it took."""

    skipped: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, tier: str, message: str) -> None:
        self.skipped[(tier, message)] = self.skipped.get((tier, message), 0) + 1

    def lines(self) -> list[str]:
        return [f"skipped tier {message} ({count} test{'s' if count != 1 else ''})"
                for (_, message), count in sorted(self.skipped.items())]


LEDGER = Ledger()


def needs(tier: str, missing: Sequence[str] | str, *, opt_in: bool = False) -> pytest.MarkDecorator:
    """A mark: the tests it marks need `missing` to be empty (tool names, files, or a sentence)."""
    mark: pytest.MarkDecorator = getattr(pytest.mark, MARK)(tier=tier, missing=_what(missing), opt_in=opt_in)
    return mark


def require(tier: str, missing: Sequence[str] | str, *, opt_in: bool = False,
            environ: Mapping[str, str] = os.environ) -> None:
    """Inside a test or fixture: return if nothing is missing, else fail (CI) or skip, recording the tier."""
    decided = verdict(tier, missing, ci=in_ci(environ), opt_in=opt_in)
    if decided is None:
        return
    if decided.fail:
        pytest.fail(decided.message, pytrace=False)
    LEDGER.add(tier, decided.message)
    pytest.skip(decided.message)


def enforce(item: pytest.Item) -> None:
    """Apply every `needs` mark of `item` (the root conftest calls this before the item's fixtures)."""
    for mark in item.iter_markers(MARK):
        require(mark.kwargs["tier"], mark.kwargs["missing"], opt_in=mark.kwargs["opt_in"])


def report(write_line: Callable[[str], object], environ: Mapping[str, str] = os.environ) -> None:
    """Print the ledger (`write_line`: the terminal's) and append it to the file `CSI_QSD_SKIPPED_TIERS` names."""
    lines = LEDGER.lines()
    for line in lines:
        write_line(line)
    path = environ.get(REPORT_FILE_ENV)
    if path and lines:
        with open(Path(path), "a") as out:
            out.writelines(f"{line}\n" for line in lines)
