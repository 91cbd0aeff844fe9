"""The data of one run in ``gpu-energy-exporter report``, whatever its source: the ledger's summary and a
timeline of aligned samples (``RunData``), and the one error the report raises (``ReportError``).

Plain data: this module never does I/O, never plots and never formats text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.core.errors import ExporterError


class ReportError(ExporterError):
    """The report cannot be made; the message says why and what to do."""


@dataclass
class RunData:
    """One run: the ledger's summary (column names of docs/ledger.md) and a timeline.

    Timeline lists are aligned with ``t`` (unix seconds); ``power_w`` has one list per GPU of ``gpus``;
    ``energy_j`` is cumulative since the run started; None marks a missing value.
    """

    run_id: str
    source: str
    summary: dict[str, Any]
    gpus: list[dict[str, Any]] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    t: list[float] = field(default_factory=list)
    power_w: list[list[float | None]] = field(default_factory=list)
    energy_j: list[float | None] = field(default_factory=list)
    tokens: list[float | None] = field(default_factory=list)
    steps: list[float | None] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    vram_bytes: list[float | None] = field(default_factory=list)
    host_available_bytes: list[float | None] = field(default_factory=list)
    host_critical_bytes: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def simulated(self) -> bool:
        text = " ".join(str(self.summary.get(k) or "") for k in ("gpu_models", "notes", "gpu_uuids"))
        return "(simulated)" in text or "simulated by gpu-energy-exporter demo" in text or "GPU-SIM" in text

    @property
    def label(self) -> str:
        backend = self.summary.get("backend")
        return f"{self.run_id} ({backend})" if backend and backend not in self.run_id else self.run_id


def num(value: Any) -> float | None:
    """A finite float, else None (booleans, text, NaN and infinities are no figures)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None
