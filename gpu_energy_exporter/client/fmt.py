"""Text formatting shared by the workstation commands (``top``, ``report``, ``runs``): CO2, durations, GiB
and a run's rank coverage, so that one figure reads the same in every command.

Plain functions of numbers to strings: this module never does I/O and never imports anything of the
package but ``core``. Number formatting shared with the daemon (``fmt_num``) is ``core/textfmt.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

GIB = float(1 << 30)


def fmt_co2(grams: float | None) -> str:
    if grams is None or not math.isfinite(grams):
        return "-"
    if abs(grams) < 10:
        return f"{grams:.2f} g"
    if abs(grams) < 1000:
        return f"{grams:.1f} g"
    return f"{grams / 1000:.2f} kg"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    total = int(round(seconds))
    h, m, s = total // 3600, total % 3600 // 60, total % 60
    if h >= 100:
        return f"{h // 24}d{h % 24:02d}h"
    return f"{h}:{m:02d}:{s:02d}"


def fmt_gib(value: float | None) -> str:
    """GiB with one decimal, without the unit (a table column or a ``used/total GiB`` pair)."""
    return "-" if value is None else f"{value / GIB:.1f}"


def _count(value: object) -> int | None:
    try:
        n = float(str(value)) if value not in (None, "") else math.nan
    except ValueError:
        return None
    return int(n) if math.isfinite(n) and n >= 1 and n.is_integer() else None


def rank_coverage(run: Mapping[str, Any]) -> str | None:
    """``"2 of 4 ranks on this node"`` when the ledger that wrote ``run`` (a summary or CSV row) saw fewer
    ranks than the run's ``world_size`` (pushed by the training helper): its tokens, energy and J/token
    then cover those ranks only; ``"50% of the tokens from this node's GPUs"`` when ranks whose GPUs are on
    other nodes pushed to it (``token_coverage`` below 1: their tokens are in no figure). None when it saw
    every rank, or the world size is unknown. Rows read back from Prometheus over every node set
    ``ranks_scope`` (``"in Prometheus"``)."""
    world, ranks = _count(run.get("world_size")), _count(run.get("ranks"))
    share = run.get("token_coverage")
    if isinstance(share, (int, float)) and math.isfinite(share) and share < 0.9995:
        # Ranks of other nodes pushed here: their tokens are in no figure of this node's ledger.
        return f"{share:.0%} of the tokens from this node's GPUs"
    if world is None or ranks is None or ranks >= world:
        return None
    scope = run.get("ranks_scope") or "on this node"
    return f"{ranks} of {world} ranks {scope}"


def fmt_mfu(ratio: float | None) -> str:
    """Model FLOPs utilisation as a percentage ("41.3%"), "-" when the run has none (no FLOPs pushed, or
    no peak for its GPUs and precision: docs/measurement.md)."""
    if ratio is None or isinstance(ratio, bool) or not math.isfinite(ratio):
        return "-"
    return f"{ratio * 100:.1f}%"


__all__ = ["GIB", "fmt_co2", "fmt_duration", "fmt_gib", "fmt_mfu", "rank_coverage"]


#: The mark of a figure not settled by an energy-counter read yet (docs/measurement.md, "Settlement").
PROVISIONAL_MARK = "~"
PROVISIONAL_NOTE = ("~: provisional, the power readings' estimate since the GPUs' last energy-counter read "
                    "(settled at the next read, at most --collector.energy-interval later)")


def is_provisional(run: Mapping[str, Any]) -> bool:
    """Whether a run's energy figures include energy no counter read has settled yet."""
    part = run.get("energy_provisional_j")
    return isinstance(part, (int, float)) and part > 0


def provisional(text: str, run: Mapping[str, Any]) -> str:
    """``text`` marked as provisional when the run's energy is not all settled (and it shows a figure)."""
    return PROVISIONAL_MARK + text if text != "-" and is_provisional(run) else text



SERVING_MARK = " (serving)"
SERVING_NOTE = "J/token is J per output token"


def is_serving(run: Mapping[str, Any]) -> bool:
    """A local inference server's session (``--collector.inference``): ``kind`` in the API and the database;
    its run id in the CSV, which has no kind column."""
    return run.get("kind") == "serving" or (run.get("kind") is None and str(run.get("run_id") or "").startswith(
        "serving-"))
