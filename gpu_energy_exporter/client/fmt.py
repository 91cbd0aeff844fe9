"""Text formatting shared by the workstation commands (``top``, ``report``, ``runs``): CO2, durations and
GiB, so that one figure reads the same in every command.

Plain functions of numbers to strings: this module never does I/O and never imports anything of the
package but ``core``. Number formatting shared with the daemon (``fmt_num``) is ``core/textfmt.py``.
"""

from __future__ import annotations

import math

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


def fmt_mfu(ratio: float | None) -> str:
    """Model FLOPs utilisation as a percentage ("41.3%"), "-" when the run has none (no FLOPs pushed, or
    no peak for its GPUs and precision: docs/measurement.md)."""
    if ratio is None or isinstance(ratio, bool) or not math.isfinite(ratio):
        return "-"
    return f"{ratio * 100:.1f}%"


__all__ = ["GIB", "fmt_co2", "fmt_duration", "fmt_gib", "fmt_mfu"]
