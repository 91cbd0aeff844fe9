"""Number formatting and JSON clean-up shared by the ledger, ``runs``, ``top`` and ``report``."""

from __future__ import annotations

import math
from typing import Any


def fmt_num(value: float | None) -> str:
    """Readable at any magnitude: 12,345 / 12.35 / 0.0123."""
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    if value == 0:
        return "0"
    return f"{value:#.3g}"


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null (recursively through dicts and lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
