"""How a bench prints: ratios to the baseline, figures, plain tables, progress lines, and a check's verdict.

`verdict` turns a check into PASS, MISS or, when the check itself raised, FAIL: a bench never passes unrun.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence


def ratio(value: float, baseline: float) -> str:
    """`value / baseline` as '12.3x' (two significant digits under 0.1: '0.0012x'), or '-' when the baseline is zero."""
    if baseline <= 0:
        return "-"
    r = value / baseline
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"



def figure(value: float) -> str:
    """IOPS or MiB/s: whole above 100, else one decimal."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"



def ms(value: float) -> str:
    return f"{value:.0f}" if value >= 1000 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"



def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])



def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)



def verdict(test: Callable[[], object], miss: str = "MISS") -> str:
    """PASS if `test()` holds, else `miss`; FAIL (with why) if the check itself raised: it never passes unrun."""
    try:
        return "PASS" if test() else miss
    except Exception as exc:
        return f"FAIL (the check raised {exc!r})"
