"""``gpu-energy-exporter report RUN...``: a per-run report (Markdown and a self-contained HTML page) with
PNG plots, or a comparison report for several runs (for example one backend against another).

Where the data comes from, for each RUN:

- a JSON summary file the run ledger wrote (``<dir of --runs.csv>/runs/<run id>.json``): pass its path;
- a running exporter (``--url``, default ``$GPU_ENERGY_EXPORTER_URL`` or ``http://localhost:9863``): its
  ``/api/v1/run?id=RUN``, the ledger's summary and bounded timeline of active and recent runs;
- a Prometheus server (``--prometheus URL``) that scraped the exporter: the run's time span from the
  ledger's ``gpuenergy_run_*`` series (else from ``training_run_finished``), then ``query_range`` over it
  for the ``gpuenergy_gpu_*`` and ``training_*`` series of the run's GPUs and exporter instance. The
  summary uses the ledger's own figures when Prometheus has them, else computes them from the samples
  (and says so).

Plots (matplotlib with the Agg backend, imported only here and only when plotting): power over time per
GPU, energy per step, loss against cumulative energy, VRAM and host memory over time, tokens/s; with
several runs also bar charts of J/token, tokens/s, energy and average power, and the loss-against-energy
curves overlaid. The summary numbers are the ledger's (``report.json`` holds exactly what was printed).

This module only reads from the exporter or Prometheus and writes only under ``--out``; it never calls
NVML and never changes the ledger.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from gpu_energy_exporter import __version__
from gpu_energy_exporter.client.api import ExporterClient, ExporterUnreachable, add_client_flags, client_from_args
from gpu_energy_exporter.client.top import fmt_co2, fmt_duration
from gpu_energy_exporter.core import runs_schema
from gpu_energy_exporter.core.config import parse_duration
from gpu_energy_exporter.core.errors import ExporterError
from gpu_energy_exporter.core.runs_schema import SUMMARY_SCHEMA
from gpu_energy_exporter.core.textfmt import fmt_num, json_safe


def fmt_energy(joules: float | None) -> str:
    """J below 1 kJ, kJ below 0.1 kWh, then kWh: a report's figures span from J per 10k tokens to a run."""
    if joules is None or not math.isfinite(joules):
        return "-"
    if abs(joules) < 1000:
        return f"{joules:.0f} J"
    if abs(joules) < 360_000:
        return f"{joules / 1000:.1f} kJ"
    return f"{joules / 3.6e6:.3f} kWh"


#: Size of every plot, in pixels (inches x DPI): tests check it.
PLOT_SIZE_IN = (10.0, 4.0)
PLOT_DPI = 100
GIB = float(1 << 30)
PLOTS: tuple[tuple[str, str], ...] = (
    ("power", "Power over time, per GPU"),
    ("energy_per_step", "Energy per optimizer step"),
    ("loss_vs_energy", "Loss against cumulative energy"),
    ("memory", "GPU memory (VRAM) and host memory over time"),
    ("tokens_per_s", "Throughput (tokens/s) over time"),
)
COMPARISON_PLOTS: tuple[tuple[str, str], ...] = (
    ("comparison", "J/token, tokens/s, energy and average power per run"),
    ("comparison_loss_vs_energy", "Loss against cumulative energy, all runs"),
)


class ReportError(ExporterError):
    """The report cannot be made; the message says why and what to do."""


# ----------------------------------------------------------------------------------------------------
# the data of one run, whatever its source


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


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def from_ledger_document(doc: dict[str, Any], source: str) -> RunData:
    """A run from the ledger's run document (``/api/v1/run`` or a JSON summary file)."""
    if not isinstance(doc, dict) or "run_id" not in doc:
        raise ReportError(f"{source} is not a run document of the gpu-energy-exporter run ledger")
    if doc.get("schema") not in (None, SUMMARY_SCHEMA):
        raise ReportError(f"{source} has schema {doc.get('schema')!r}; this version reads {SUMMARY_SCHEMA!r}")
    gpus = [g for g in doc.get("gpus") or [] if isinstance(g, dict)]
    order = [str(u) for u in doc.get("timeline_gpus") or [g.get("uuid") for g in gpus]]
    by_uuid = {g.get("uuid"): g for g in gpus}
    run = RunData(run_id=str(doc["run_id"]), source=source, summary=dict(doc),
                  gpus=[by_uuid.get(u) or {"uuid": u, "name": ""} for u in order],
                  start=_num(doc.get("start_unix")), end=_num(doc.get("end_unix")))
    run.power_w = [[] for _ in order]
    for p in doc.get("timeline") or []:
        t = _num(p.get("t"))
        if t is None:
            continue
        run.t.append(t)
        powers = p.get("power_w") or []
        for i in range(len(order)):
            run.power_w[i].append(_num(powers[i]) if i < len(powers) else None)
        run.energy_j.append(_num(p.get("energy_j")))
        run.tokens.append(_num(p.get("tokens")))
        run.steps.append(_num(p.get("steps")))
        run.loss.append(_num(p.get("loss")))
        run.vram_bytes.append(_num(p.get("vram_used_bytes")))
        run.host_available_bytes.append(_num(p.get("host_memory_available_bytes")))
    if run.start is None and run.t:
        run.start = run.t[0]
    return run


def load_file(path: str) -> RunData:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"{path!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ReportError(f"cannot read the run summary {path!r}: {exc}") from None
    return from_ledger_document(doc, path)


def load_from_exporter(client: ExporterClient, run_id: str) -> RunData:
    try:
        doc = client.get("/api/v1/run", {"id": run_id})
    except ExporterUnreachable as exc:
        text = str(exc)
        if "unknown run" in text:
            text += (". The exporter keeps finished runs for 15 minutes: for older runs pass the JSON summary "
                     "file (runs/<run id>.json beside its --runs.csv) or --prometheus URL")
        raise ReportError(text) from None
    run = from_ledger_document(doc, f"exporter {client.base_url}")
    try:
        status = client.get("/api/v1/status")
        run.host_critical_bytes = _num((status.get("host") or {}).get("memory_critical_bytes"))
    except (ExporterUnreachable, AttributeError):
        pass  # the threshold line is a nicety
    return run


# ----------------------------------------------------------------------------------------------------
# Prometheus


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _uuid_regex(uuids: Sequence[str]) -> str:
    return "|".join(re.escape(u).replace("\\", "\\\\").replace('"', '\\"') for u in uuids)


class PrometheusSource:
    """Reads one run from a Prometheus server that scraped the exporter."""

    def __init__(self, client: ExporterClient, since: float = 7 * 86400.0, max_points: int = 600,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.client = client
        self.since = since
        self.max_points = max_points
        self.progress = progress

    def _data(self, path: str, query: dict[str, str]) -> Any:
        try:
            doc = self.client.get(path, query)
        except ExporterUnreachable as exc:
            raise ReportError(str(exc).replace("the exporter", "Prometheus")) from None
        if not isinstance(doc, dict) or doc.get("status") != "success":
            raise ReportError(f"Prometheus at {self.client.base_url} answered an error for {query.get('query')!r}: "
                              f"{doc.get('error') if isinstance(doc, dict) else doc!r}")
        return doc["data"]

    def instant(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        q = {"query": expr}
        if at is not None:
            q["time"] = f"{at:.3f}"
        return list(self._data("/api/v1/query", q)["result"])

    def range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self._data("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                       "step": f"{step:g}"})["result"])

    def _window(self) -> str:
        return f"{int(self.since)}s"

    def span(self, run_id: str) -> tuple[float, float, str, dict[str, str]]:
        """(start, end, how it was found, labels of one of the run's series)."""
        rid = _label_value(run_id)
        duration = _ledger_name("RUN_DURATION")
        raw = self.instant(f'{duration}{{run_id="{rid}"}}[{self._window()}]')
        if raw:
            # The ledger's duration at each scrape: start = scrape time - duration, exact to the ledger.
            samples = [(float(ts), float(v)) for s in raw for ts, v in s["values"]]
            first_ts, first_v = min(samples)
            start = first_ts - first_v
            end = start + max(v for _, v in samples)
            return start, end, f"the run ledger's {duration}", dict(raw[0]["metric"])
        raw = self.instant(f'training_run_finished{{run_id="{rid}"}}[{self._window()}]')
        if not raw:
            raise ReportError(
                f"run {run_id!r} not found in Prometheus at {self.client.base_url} over the last "
                f"{fmt_duration(self.since)} (no {_ledger_name('RUN_DURATION')} or training_run_finished series "
                "with that run_id): is Prometheus scraping the exporter, and is the run id right? For older runs "
                "pass --since")
        start = min(float(s["values"][0][0]) for s in raw)
        ends = []
        for s in raw:
            done = [float(ts) for ts, v in s["values"] if float(v) >= 1]
            ends.append(min(done) if done else float(s["values"][-1][0]))
        return start, max(ends), "training_run_finished (to the scrape interval)", dict(raw[0]["metric"])

    def load(self, run_id: str) -> RunData:
        self.progress(f"finding run {run_id} in Prometheus")
        start, end, how, labels = self.span(run_id)
        rid = _label_value(run_id)
        instance = labels.get("instance")
        inst = f', instance="{_label_value(instance)}"' if instance else ""
        window = self._window()
        # The run's GPUs and metadata.
        uuids: list[str] = []
        for expr in (f'training_run_gpu_info{{run_id="{rid}"}}', f'{_ledger_name("RUN_INFO")}{{run_id="{rid}"}}',
                     f'training_tokens_total{{run_id="{rid}"}}'):
            for s in self.instant(f"last_over_time({expr}[{window}])"):
                for u in s["metric"].get("gpu_uuid", "").split(","):
                    u = u.strip()
                    if u and u.lower() not in ("none", "unknown") and u not in uuids:
                        uuids.append(u)
            if uuids:
                break
        meta: dict[str, Any] = {}
        for s in self.instant(f'last_over_time(training_run_info{{run_id="{rid}"}}[{window}])'):
            if not meta or s["metric"].get("rank") == "0":
                meta = {k: v for k, v in s["metric"].items()
                        if k not in ("__name__", "run_id", "rank", "gpu_uuid", "instance", "job")}
        span = max(1.0, end - start)
        step = max(1.0, math.ceil(span / self.max_points))
        # One point before the start: counters there are the baseline.
        lo = round(start - step, 3)
        n = int(math.ceil((end - lo) / step)) + 1
        hi = lo + (n - 1) * step
        grid = [lo + i * step for i in range(n)]
        run = RunData(run_id=run_id, source=f"Prometheus {self.client.base_url}", summary={}, start=start, end=end)
        run.notes.append(f"time span from {how}; series sampled every {step:g}s by query_range")
        sel = f'gpu_uuid=~"{_uuid_regex(uuids)}"{inst}' if uuids else None

        def series(expr: str) -> list[dict[str, Any]]:
            return self.range(expr, lo, hi, step)

        def on_grid(values: list[list[Any]]) -> list[float | None]:
            out: list[float | None] = [None] * len(grid)
            for ts, v in values:
                i = int(round((float(ts) - lo) / step))
                if 0 <= i < len(grid):
                    out[i] = _finite(float(v))
            return out

        def aligned(result: list[dict[str, Any]]) -> list[float | None]:
            return on_grid(result[0]["values"]) if result else [None] * len(grid)

        queries = 8
        done = 0

        def tick(what: str) -> None:
            nonlocal done
            done += 1
            self.progress(f"querying {what} ({done}/{queries})")

        names: dict[str, str] = {}
        power: dict[str, list[float | None]] = {}
        if sel:
            for s in self.instant(f"last_over_time(gpuenergy_gpu_info{{{sel}}}[{window}])"):
                names[s["metric"].get("gpu_uuid", "")] = s["metric"].get("model", "")
            for s in series(f"gpuenergy_gpu_power_watts{{{sel}}}"):
                power[s["metric"].get("gpu_uuid", "")] = on_grid(s["values"])
        tick("GPU power")
        energy = aligned(series(f"sum(gpuenergy_gpu_energy_joules_total{{{sel}}})")) if sel else [None] * len(grid)
        tick("GPU energy")
        tokens = aligned(series(f'sum(training_tokens_total{{run_id="{rid}"}})'))
        tick("tokens")
        steps = aligned(series(f'max(training_steps_total{{run_id="{rid}"}})'))
        tick("steps")
        loss_series = series(f'training_loss{{run_id="{rid}"}}')
        loss_series.sort(key=lambda s: _rank_key(s["metric"].get("rank", "")))
        loss = aligned(loss_series[:1])
        tick("loss")
        vram = aligned(series(f"sum(gpuenergy_gpu_memory_used_bytes{{{sel}}})")) if sel else [None] * len(grid)
        tick("VRAM")
        host = aligned(series(f"gpuenergy_host_memory_available_bytes{{{inst[2:]}}}" if inst else
                              "gpuenergy_host_memory_available_bytes"))
        crit = self.instant(f"gpuenergy_host_memory_critical_bytes{{{inst[2:]}}}" if inst else
                            "gpuenergy_host_memory_critical_bytes", at=end)
        run.host_critical_bytes = float(crit[0]["value"][1]) if len(crit) == 1 else None
        tick("host memory")
        intensity = aligned(series(f"max(gpuenergy_carbon_intensity_grams_per_kilowatt_hour{{{inst[2:]}}})"))
        pue = aligned(series(f"max(gpuenergy_datacenter_pue{{{inst[2:]}}})"))
        tick("carbon intensity")

        base_e = next((e for e in energy if e is not None), None)
        # Keep the grid points inside the run; the point before the start only served as the baseline.
        keep = [i for i, t in enumerate(grid) if t >= start - 1e-6]
        run.t = [grid[i] for i in keep]
        run.gpus = [{"uuid": u, "name": names.get(u, "")} for u in (uuids or list(power))]
        run.power_w = [[power.get(g["uuid"], [None] * len(grid))[i] for i in keep] for g in run.gpus]
        run.energy_j = [_minus(energy[i], base_e) for i in keep]
        run.tokens = [tokens[i] for i in keep]
        run.steps = [steps[i] for i in keep]
        run.loss = [loss[i] for i in keep]
        run.vram_bytes = [vram[i] for i in keep]
        run.host_available_bytes = [host[i] for i in keep]
        run.summary = self._summary(run, rid, meta, intensity, pue, end)
        return run

    def _summary(self, run: RunData, rid: str, meta: dict[str, Any], intensity: list[float | None],
                 pue: list[float | None], end: float) -> dict[str, Any]:
        duration = (run.end or 0.0) - (run.start or 0.0)
        energy = _last(run.energy_j)
        tokens = _last(run.tokens)
        totals = [sum(v for v in vals if v is not None) if any(v is not None for v in vals) else None
                  for vals in zip(*run.power_w, strict=True)] if run.power_w else []
        known_i = [v for v in intensity if v is not None]
        known_p = [v for v in pue if v is not None]
        mean_i = sum(known_i) / len(known_i) if known_i else None
        mean_p = sum(known_p) / len(known_p) if known_p else 1.0
        j_per_token = energy / tokens if energy is not None and tokens else None
        summary: dict[str, Any] = {
            "run_id": run.run_id, "status": None, "duration_s": duration, "warmup_s": 0.0, "window_s": duration,
            **meta,
            "gpu_count": len(run.gpus), "gpu_uuids": " ".join(g["uuid"] for g in run.gpus),
            "gpu_models": "; ".join(sorted({g["name"] for g in run.gpus if g["name"]})),
            "tokens": tokens, "steps": _last(run.steps),
            "tokens_per_s": tokens / duration if tokens is not None and duration > 0 else None,
            "j_per_token": j_per_token,
            "energy_per_10k_tokens_j": j_per_token * 10_000 if j_per_token is not None else None,
            "energy_j": energy, "energy_kwh": energy / 3.6e6 if energy is not None else None,
            "avg_power_w": energy / duration if energy is not None and duration > 0 else None,
            "peak_power_w": max((v for v in totals if v is not None), default=None),
            "vram_peak_bytes": max((v for v in run.vram_bytes if v is not None), default=None),
            "co2_g": energy / 3.6e6 * mean_p * mean_i if energy is not None and mean_i is not None else None,
            "carbon_intensity_g_per_kwh": mean_i, "pue": mean_p,
            "best_loss": min((v for v in run.loss if v is not None), default=None),
            "last_loss": _last(run.loss),
        }
        # The ledger's own figures, where Prometheus scraped them, replace the ones computed from samples.
        found = 0
        for key, name in _ledger_series().items():
            result = self.instant(f'last_over_time({name}{{run_id="{rid}"}}[{self._window()}])')
            if len(result) == 1:
                summary[key] = _finite(float(result[0]["value"][1]))
                found += 1
        info = self.instant(f'last_over_time({_ledger_name("RUN_INFO")}{{run_id="{rid}"}}[{self._window()}])')
        if info:
            summary["status"] = info[0]["metric"].get("status")
        if found:
            e, jpt, dyn = summary.get("energy_j"), summary.get("j_per_token"), summary.get("dynamic_energy_j")
            summary["energy_kwh"] = e / 3.6e6 if e is not None else None
            summary["energy_per_10k_tokens_j"] = jpt * 10_000 if jpt is not None else None
            summary["idle_energy_j"] = e - dyn if e is not None and dyn is not None else None
            # The ledger's efficiency figures exclude its --runs.warmup, which Prometheus does not know.
            summary["warmup_s"] = summary["window_s"] = None
            run.notes.append("summary figures are the run ledger's (gpuenergy_run_* series), as last scraped")
        else:
            run.notes.append("no run-ledger series in Prometheus: figures computed from the sampled series "
                             "(whole run, no warm-up excluded; energy from the counters at the scrape interval)")
        return summary


#: Summary keys -> the ledger's metric specs serving them on /metrics (core/runs_schema.py).
_LEDGER_SPECS = {
    "energy_j": "RUN_ENERGY", "tokens": "RUN_TOKENS", "steps": "RUN_STEPS", "tokens_per_s": "RUN_TOKENS_PER_SECOND",
    "j_per_token": "RUN_JOULES_PER_TOKEN", "avg_power_w": "RUN_AVERAGE_POWER", "peak_power_w": "RUN_PEAK_POWER",
    "vram_peak_bytes": "RUN_MEMORY_PEAK", "co2_g": "RUN_CO2", "duration_s": "RUN_DURATION",
    "dynamic_energy_j": "RUN_DYNAMIC_ENERGY",
}


def _ledger_name(spec: str) -> str:
    """The Prometheus name of a ledger series, from the ledger's own catalogue entry."""
    return str(getattr(runs_schema, spec).name)


def _ledger_series() -> dict[str, str]:
    return {key: str(getattr(runs_schema, spec).name) for key, spec in _LEDGER_SPECS.items()
            if hasattr(runs_schema, spec)}


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _last(values: Sequence[float | None]) -> float | None:
    for v in reversed(values):
        if v is not None:
            return v
    return None


def _rank_key(rank: str) -> tuple[int, str]:
    try:
        return (int(rank), "")
    except ValueError:
        return (1 << 30, rank)


# ----------------------------------------------------------------------------------------------------
# derived series


def change_points(t: Sequence[float], values: Sequence[float | None]) -> list[tuple[float, float]]:
    """(t, value) where the value changed: counters and gauges pushed over OTLP move only when an export
    arrives, so rates between consecutive change points are exact, and between snapshots they are not."""
    out: list[tuple[float, float]] = []
    for ti, v in zip(t, values, strict=True):
        if v is None:
            continue
        if not out or v != out[-1][1]:
            out.append((ti, v))
    return out


def rate_window(run: RunData) -> float:
    """Seconds over which rates are averaged: counters move only when an export arrives and snapshots come
    every second, so shorter windows show the two clocks beating against each other, not the run."""
    span = (run.t[-1] - run.t[0]) if len(run.t) > 1 else 0.0
    return max(5.0, span / 60.0)


def _windows(points: Sequence[tuple[float, ...]], min_dt: float) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
    """Consecutive (first, last) pairs of ``points`` (sorted by their first item, time) at least ``min_dt``
    apart; a short remainder at the end joins the last window."""
    out: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
    if len(points) < 2:
        return out
    a = points[0]
    for b in points[1:]:
        if b[0] - a[0] >= min_dt:
            out.append((a, b))
            a = b
    last = points[-1]
    if a is not last:
        if out and last[0] - a[0] < min_dt / 2:
            out[-1] = (out[-1][0], last)
        else:
            out.append((a, last))
    return out


def tokens_per_second(run: RunData) -> list[tuple[float, float, float]]:
    """(window start, window end, tokens/s) over windows of ``rate_window`` seconds."""
    pts = change_points(run.t, run.tokens)
    return [(a[0], b[0], (b[1] - a[1]) / (b[0] - a[0])) for a, b in _windows(pts, rate_window(run))
            if b[0] > a[0] and b[1] >= a[1]]


def energy_per_step(run: RunData) -> list[tuple[float, float]]:
    """(step at the window's end, joules per step) over windows of ``rate_window`` seconds, taken where the
    step count changed."""
    pts: list[tuple[float, ...]] = []
    for t, s, e in zip(run.t, run.steps, run.energy_j, strict=True):
        if s is None or e is None:
            continue
        if not pts or s != pts[-1][1]:
            pts.append((t, s, e))
    return [(b[1], (b[2] - a[2]) / (b[1] - a[1])) for a, b in _windows(pts, rate_window(run)) if b[1] > a[1]]


def loss_vs_energy(run: RunData) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    last: float | None = None
    for loss, e in zip(run.loss, run.energy_j, strict=True):
        if loss is None or e is None or loss == last:
            continue
        out.append((e, loss))
        last = loss
    return out


# ----------------------------------------------------------------------------------------------------
# plots


def _matplotlib() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 - optional extra, only for this command
    except ImportError:
        raise ReportError(
            "report draws its plots with matplotlib, which is not installed in this Python environment "
            f"({sys.prefix}): install it with `{sys.executable} -m pip install 'matplotlib>=3.7'` (from a "
            "checkout, `make run` and `pip install '.[report]'` include it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _minutes(run: RunData) -> list[float]:
    t0 = run.start if run.start is not None else (run.t[0] if run.t else 0.0)
    return [(t - t0) / 60.0 for t in run.t]


def _energy_unit(max_j: float) -> tuple[float, str]:
    if max_j >= 360_000:
        return 3.6e6, "kWh"
    if max_j >= 1000:
        return 1000.0, "kJ"
    return 1.0, "J"


def _figure(plt: Any, title: str, run: RunData | None = None, ncols: int = 1, nrows: int = 1) -> tuple[Any, Any]:
    fig, ax = plt.subplots(nrows, ncols, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    suffix = "  [SIMULATED DATA]" if run is not None and run.simulated else ""
    fig.suptitle(title + suffix, fontsize=11, color="#b00000" if suffix else "black")
    return fig, ax


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run's data", ha="center", va="center", transform=ax.transAxes,
            color="#666666")


def _whole_run(ax: Any, run: RunData) -> None:
    """Time axes span the whole run, not only the samples at hand: a plot whose samples cover 5 s of a 26 s
    run must show that, not stretch the 5 s across the page."""
    duration = _num(run.summary.get("duration_s"))
    if duration is not None and duration > 0:
        ax.set_xlim(0, duration / 60.0)


def _warmup(ax: Any, run: RunData) -> None:
    w = _num(run.summary.get("warmup_s"))
    if w:
        ax.axvspan(0, w / 60.0, color="#dddddd", alpha=0.6, lw=0, label="warm-up (not in J/token)")


def _save(fig: Any, path: str) -> str:
    fig.subplots_adjust(left=0.08, right=0.97, top=0.88, bottom=0.14)
    fig.savefig(path, dpi=PLOT_DPI, format="png")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.close(fig)
    return path


def plot_run(run: RunData, out_dir: str, plt: Any) -> dict[str, str]:
    """Write the five plots of one run; returns {plot name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    x = _minutes(run)
    paths: dict[str, str] = {}

    fig, ax = _figure(plt, f"Power per GPU: {run.run_id}", run)
    _warmup(ax, run)
    if run.t and any(v is not None for series in run.power_w for v in series):
        for g, series in zip(run.gpus, run.power_w, strict=True):
            ax.plot(x, [math.nan if v is None else v for v in series], lw=1.2,
                    label=f"{g.get('uuid', '')[:12]}… {str(g.get('name') or '').replace('NVIDIA ', '')}")
        if len(run.power_w) > 1:
            total = [sum(v for v in vals if v is not None) if all(v is not None for v in vals) else math.nan
                     for vals in zip(*run.power_w, strict=True)]
            ax.plot(x, total, lw=1.5, ls="--", color="black", label="all the run's GPUs")
        peak = _num(run.summary.get("peak_power_w"))
        avg = _num(run.summary.get("avg_power_w"))
        if avg is not None:
            ax.axhline(avg, color="#888888", lw=1, ls=":", label=f"average {avg:,.0f} W")
        if peak is not None:
            ax.set_ylim(0, max(peak, *(v for s in run.power_w for v in s if v is not None)) * 1.1)
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "power samples")
    _whole_run(ax, run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("power (W)")
    ax.grid(alpha=0.3)
    paths["power"] = _save(fig, os.path.join(out_dir, "power.png"))

    fig, ax = _figure(plt, f"Energy per optimizer step: {run.run_id}", run)
    eps = energy_per_step(run)
    if eps:
        ax.plot([s for s, _ in eps], [j for _, j in eps], marker=".", lw=1, color="#d95f02",
                label=f"over {rate_window(run):.0f} s windows")
        energy, steps = _num(run.summary.get("energy_j")), _num(run.summary.get("steps"))
        if energy is not None and steps:
            ax.axhline(energy / steps, color="#888888", ls=":", lw=1, label=f"run mean {energy / steps:,.1f} J/step")
        ax.legend(loc="lower right", fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax, "step counts")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("energy per step (J)")
    ax.grid(alpha=0.3)
    paths["energy_per_step"] = _save(fig, os.path.join(out_dir, "energy_per_step.png"))

    fig, ax = _figure(plt, f"Loss against cumulative energy: {run.run_id}", run)
    lve = loss_vs_energy(run)
    if lve and max(e for e, _ in lve) > 0:
        scale, unit = _energy_unit(max(e for e, _ in lve))
        ax.plot([e / scale for e, _ in lve], [v for _, v in lve], marker=".", lw=1, color="#1b9e77")
        ax.set_xlabel(f"cumulative GPU energy of the run ({unit})")
    else:
        _no_data(ax, "loss values" if not lve else "GPU energy (the run's GPUs reported none)")
        ax.set_xlabel("cumulative GPU energy of the run")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    paths["loss_vs_energy"] = _save(fig, os.path.join(out_dir, "loss_vs_energy.png"))

    fig, ax = _figure(plt, f"Memory: {run.run_id}", run)
    has_vram = any(v is not None for v in run.vram_bytes)
    has_host = any(v is not None for v in run.host_available_bytes)
    if has_vram:
        ax.plot(x, [math.nan if v is None else v / GIB for v in run.vram_bytes], lw=1.4, color="#7570b3",
                label="VRAM used, the run's GPUs (GiB)")
        vram_total = _num(run.summary.get("vram_total_bytes"))
        if vram_total:
            ax.axhline(vram_total / GIB, color="#7570b3", ls=":", lw=1, label=f"VRAM total {vram_total / GIB:.0f} GiB")
    if has_host:
        ax.plot(x, [math.nan if v is None else v / GIB for v in run.host_available_bytes], lw=1.4,
                color="#e7298a", label="host RAM available (GiB)")
        if run.host_critical_bytes:
            ax.axhline(run.host_critical_bytes / GIB, color="#e7298a", ls="--", lw=1,
                       label=f"host RAM critical {run.host_critical_bytes / GIB:.1f} GiB")
    if has_vram or has_host:
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "memory samples")
    _whole_run(ax, run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3)
    paths["memory"] = _save(fig, os.path.join(out_dir, "memory.png"))

    fig, ax = _figure(plt, f"Throughput: {run.run_id}", run)
    _warmup(ax, run)
    tps = tokens_per_second(run)
    if tps:
        t0 = run.start if run.start is not None else run.t[0]
        xs = [(a - t0) / 60.0 for a, _, _ in tps] + [(tps[-1][1] - t0) / 60.0]
        ys = [v for _, _, v in tps] + [tps[-1][2]]
        ax.step(xs, ys, where="post", lw=1.4, color="#66a61e", label=f"over {rate_window(run):.0f} s windows")
        window = _num(run.summary.get("tokens_per_s"))
        if window is not None:
            ax.axhline(window, color="#888888", ls=":", lw=1, label=f"ledger {window:,.0f} tokens/s (after warm-up)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "token counts")
    _whole_run(ax, run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    paths["tokens_per_s"] = _save(fig, os.path.join(out_dir, "tokens_per_s.png"))
    return paths


def _bar_labels(runs: Sequence[RunData]) -> list[str]:
    """Short x labels: the backends when they tell the runs apart, else #1, #2 (the legend names them)."""
    backends = [str(r.summary.get("backend") or "") for r in runs]
    if all(backends) and len(set(backends)) == len(backends):
        return backends
    return [f"#{i}" for i in range(1, len(runs) + 1)]


def plot_comparison(runs: Sequence[RunData], out_dir: str, plt: Any) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    labels = _bar_labels(runs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sim = any(r.simulated for r in runs)
    fig, axes = plt.subplots(1, 4, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    fig.suptitle("Runs compared" + ("  [SIMULATED DATA]" if sim else ""), fontsize=11,
                 color="#b00000" if sim else "black")
    for ax, (key, title, scale) in zip(axes, (
            ("j_per_token", "J/token", 1.0), ("tokens_per_s", "tokens/s", 1.0),
            ("energy_kwh", "energy (kWh)", 1.0), ("avg_power_w", "average power (W)", 1.0)), strict=True):
        values = [(_num(r.summary.get(key)) or 0.0) * scale for r in runs]
        ax.bar(range(len(runs)), values, color=[colours[i % len(colours)] for i in range(len(runs))])
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(labels, fontsize=8, rotation=15 if len(runs) > 2 else 0)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    key = "   ".join(f"{label}: {r.run_id}" for label, r in zip(labels, runs, strict=True))
    fig.text(0.5, 0.03, key if len(key) < 160 else key[:157] + "...", ha="center", fontsize=7, color="#444444")
    fig.subplots_adjust(left=0.06, right=0.98, top=0.82, bottom=0.2, wspace=0.45)
    path = os.path.join(out_dir, "comparison.png")
    fig.savefig(path, dpi=PLOT_DPI, format="png")
    plt.close(fig)
    paths = {"comparison": path}

    fig, ax = _figure(plt, "Loss against cumulative energy, all runs")
    if sim:
        fig.suptitle("Loss against cumulative energy, all runs  [SIMULATED DATA]", fontsize=11, color="#b00000")
    curves = [(r, loss_vs_energy(r)) for r in runs]
    top = max((e for _, c in curves for e, _ in c), default=0.0)
    scale, unit = _energy_unit(top)
    for i, (r, c) in enumerate(curves):
        if c:
            ax.plot([e / scale for e, _ in c], [v for _, v in c], marker=".", lw=1, color=colours[i % len(colours)],
                    label=r.label)
    if any(c for _, c in curves):
        ax.legend(loc="upper right", fontsize=8)
    else:
        _no_data(ax, "loss values")
    ax.set_xlabel(f"cumulative GPU energy of the run ({unit})")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    paths["comparison_loss_vs_energy"] = _save(fig, os.path.join(out_dir, "comparison_loss_vs_energy.png"))
    return paths


# ----------------------------------------------------------------------------------------------------
# the document: blocks rendered to Markdown and to HTML


Block = tuple[Any, ...]


def _kwh(j: float | None) -> str:
    if j is None:
        return "-"
    return f"{j / 3.6e6:.4g} kWh ({j:,.0f} J)"


def _w(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f} W"


def _bytes(v: float | None) -> str:
    return "-" if v is None else f"{v / GIB:.1f} GiB"


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """The final energy summary, formatted from the ledger's figures."""
    s = run.summary
    n = {k: _num(s.get(k)) for k in s}
    warm = n.get("warmup_s")
    if "warmup_s" in s and s["warmup_s"] is None:
        window = " (after the exporter's --runs.warmup)"
    else:
        window = f" (after a {warm:g} s warm-up)" if warm else " (whole run)"
    intensity, pue = n.get("carbon_intensity_g_per_kwh"), n.get("pue")
    co2 = fmt_co2(n.get("co2_g"))
    if n.get("co2_g") is not None and intensity is not None:
        co2 += f" ({intensity:.0f} gCO2e/kWh x PUE {pue if pue is not None else 1.0:.2f})"
    rows = [
        ("total energy", _kwh(n.get("energy_j"))),
        ("average power", _w(n.get("avg_power_w"))),
        ("peak power", _w(n.get("peak_power_w"))),
        ("J/token" + window, fmt_num(n.get("j_per_token"))),
        ("energy per 10k tokens", fmt_energy(n.get("energy_per_10k_tokens_j"))),
        ("CO2", co2),
        ("tokens", f"{n['tokens']:,.0f}" if n.get("tokens") is not None else "-"),
        ("tokens/s" + window, fmt_num(n.get("tokens_per_s"))),
        ("duration", fmt_duration(n.get("duration_s"))),
        ("steps", (f"{n['steps']:,.0f}" if n.get("steps") is not None else "-")
         + (f" of {n['total_steps']:,.0f} planned" if n.get("total_steps") else "")),
    ]
    if n.get("idle_energy_j") is not None or n.get("dynamic_energy_j") is not None:
        rows.append(("idle / dynamic energy", f"{fmt_energy(n.get('idle_energy_j'))} / "
                                              f"{fmt_energy(n.get('dynamic_energy_j'))}"))
    if n.get("vram_peak_bytes") is not None:
        rows.append(("VRAM peak / average", f"{_bytes(n.get('vram_peak_bytes'))} / {_bytes(n.get('vram_avg_bytes'))}"))
    if n.get("best_loss") is not None:
        at = f" at step {n['best_loss_step']:,.0f}" if n.get("best_loss_step") is not None else ""
        rows.append(("best loss", f"{n['best_loss']:.4f}{at} (last {fmt_num(n.get('last_loss'))})"))
    if n.get("mean_step_s") is not None:
        rows.append(("mean step time", f"{n['mean_step_s']:.3f} s"))
    return rows


_META = ("status", "model", "backend", "optimizer", "precision", "batch_size", "grad_accum", "seq_len", "seed",
         "world_size", "ranks", "gpu_count", "gpu_models", "gpu_uuids", "start_time", "end_time", "notes")


def metadata_rows(run: RunData) -> list[tuple[str, str]]:
    rows = []
    for key in _META:
        value = run.summary.get(key)
        if value not in (None, ""):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            rows.append((key, str(value)))
    return rows


_COMPARE: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("backend", "backend", lambda v: str(v) if v else "-"),
    ("model", "model", lambda v: str(v) if v else "-"),
    ("energy_j", "total energy", lambda v: _kwh(_num(v))),
    ("avg_power_w", "average power", lambda v: _w(_num(v))),
    ("peak_power_w", "peak power", lambda v: _w(_num(v))),
    ("j_per_token", "J/token", lambda v: fmt_num(_num(v))),
    ("energy_per_10k_tokens_j", "energy per 10k tokens", lambda v: fmt_energy(_num(v))),
    ("tokens_per_s", "tokens/s", lambda v: fmt_num(_num(v))),
    ("co2_g", "CO2", lambda v: fmt_co2(_num(v))),
    ("vram_peak_bytes", "VRAM peak", lambda v: _bytes(_num(v))),
    ("duration_s", "duration", lambda v: fmt_duration(_num(v))),
    ("best_loss", "best loss", lambda v: fmt_num(_num(v))),
)


def build_blocks(runs: Sequence[RunData], plots: dict[str, dict[str, str]], out_dir: str) -> list[Block]:
    blocks: list[Block] = []
    title = f"Training run report: {runs[0].run_id}" if len(runs) == 1 else f"Training runs compared ({len(runs)})"
    blocks.append(("h1", title))
    if any(r.simulated for r in runs):
        blocks.append(("warn", "SIMULATED DATA: these runs were produced by `gpu-energy-exporter demo` on simulated "
                               "GPUs. The figures show how the report works; they are not measurements."))
    sources = sorted({r.source for r in runs})
    blocks.append(("p", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by gpu-energy-exporter {__version__} "
                        f"from {', '.join(sources)}. Energy comes from the GPUs' energy counters (never integrated "
                        "from power); how each figure is computed: docs/ledger.md."))
    if len(runs) > 1:
        blocks.append(("h2", "Comparison"))
        headers = ["", *(r.run_id for r in runs)]
        rows = [[label, *(fmt(r.summary.get(key)) for r in runs)] for key, label, fmt in _COMPARE]
        blocks.append(("table", headers, rows))
        base = runs[0]
        for r in runs[1:]:
            ratio = []
            for key, label in (("j_per_token", "J/token"), ("tokens_per_s", "tokens/s"), ("energy_j", "energy")):
                a, b = _num(r.summary.get(key)), _num(base.summary.get(key))
                if a is not None and b:
                    ratio.append(f"{label} {a / b:.2f}x")
            if ratio:
                blocks.append(("p", f"{r.label} against {base.label}: " + ", ".join(ratio) + "."))
        for name, caption in COMPARISON_PLOTS:
            if name in plots.get("", {}):
                blocks.append(("img", caption, plots[""][name]))
    for r in runs:
        blocks.append(("h2", "Energy summary" if len(runs) == 1 else f"Run {r.label}"))
        blocks.append(("table", ["figure", "value"], [list(row) for row in summary_rows(r)]))
        blocks.append(("h3", "Run"))
        blocks.append(("table", ["", ""], [list(row) for row in metadata_rows(r)]))
        blocks.append(("h3", "Plots"))
        for name, caption in PLOTS:
            if name in plots.get(r.run_id, {}):
                blocks.append(("img", caption, plots[r.run_id][name]))
        notes = [n for n in str(r.summary.get("ledger_notes") or "").split("; ") if n] + r.notes
        if notes:
            blocks.append(("h3", "Notes"))
            blocks.append(("ul", notes))
    return blocks


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block], out_dir: str) -> str:
    lines: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + b[1], ""]
        elif kind == "p":
            lines += [b[1], ""]
        elif kind == "warn":
            lines += [f"> **{b[1]}**", ""]
        elif kind == "table":
            headers, rows = b[1], b[2]
            lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
            lines.append("|" + "---|" * len(headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            lines.append("")
        elif kind == "img":
            rel = os.path.relpath(b[2], out_dir).replace(os.sep, "/")
            lines += [f"![{b[1]}]({rel})", ""]
        elif kind == "ul":
            lines += [f"- {item}" for item in b[1]] + [""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1080px;margin:2em auto;
padding:0 1em;color:#222}table{border-collapse:collapse;margin:0.5em 0 1.2em}td,th{border:1px solid #ccc;
padding:4px 10px;text-align:left;font-variant-numeric:tabular-nums}th{background:#f2f2f2}
.warn{background:#fff3cd;border:1px solid #e0b000;padding:0.6em 1em;font-weight:bold}
img{max-width:100%;border:1px solid #ddd;margin:0.3em 0 1.2em}figcaption{color:#555;font-size:0.9em}"""


def render_html(blocks: Sequence[Block]) -> str:
    """A self-contained page: the plots are embedded as base64 PNG data URLs."""
    esc = html.escape
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{esc(blocks[0][1]) if blocks else 'report'}</title>", f"<style>{_CSS}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{esc(b[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "warn":
            parts.append(f'<p class="warn">{_inline(b[1])}</p>')
        elif kind == "table":
            headers, rows = b[1], b[2]
            head = "" if not any(headers) else "<tr>" + "".join(f"<th>{esc(str(h))}</th>" for h in headers) + "</tr>"
            body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
            parts.append(f"<table>{head}{body}</table>")
        elif kind == "img":
            with open(b[2], "rb") as f:
                data = base64.b64encode(f.read()).decode("ascii")
            parts.append(f'<figure><img alt="{esc(b[1])}" src="data:image/png;base64,{data}">'
                         f"<figcaption>{esc(b[1])}</figcaption></figure>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{esc(str(i))}</li>" for i in b[1]) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


# ----------------------------------------------------------------------------------------------------
# making the report


def safe_name(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._")[:100] or "run"


def write_report(runs: Sequence[RunData], out_dir: str, progress: Callable[[str], None] = lambda _m: None
                 ) -> dict[str, str]:
    """Plots, report.md, report.html and report.json under ``out_dir``; returns their paths."""
    plt = _matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    plots: dict[str, dict[str, str]] = {}
    dirs: dict[str, str] = {}
    for i, r in enumerate(runs, 1):
        progress(f"plotting {r.run_id} ({i}/{len(runs)})")
        name = safe_name(r.run_id)
        while name in dirs.values():
            name += "_"
        dirs[r.run_id] = name
        plots[r.run_id] = plot_run(r, os.path.join(out_dir, name), plt)
    if len(runs) > 1:
        progress("plotting the comparison")
        plots[""] = plot_comparison(runs, out_dir, plt)
    blocks = build_blocks(runs, plots, out_dir)
    paths = {"markdown": os.path.join(out_dir, "report.md"), "html": os.path.join(out_dir, "report.html"),
             "json": os.path.join(out_dir, "report.json")}
    progress("writing report.md, report.html, report.json")
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(render_markdown(blocks, out_dir))
    with open(paths["html"], "w", encoding="utf-8") as f:
        f.write(render_html(blocks))
    doc: dict[str, Any] = {"generator": f"gpu-energy-exporter {__version__}",
                           "runs": [{"run_id": r.run_id, "source": r.source, "simulated": r.simulated,
                                     "summary": r.summary, "notes": r.notes,
                                     "plots": {k: os.path.relpath(v, out_dir) for k, v in plots[r.run_id].items()}}
                                    for r in runs]}
    if "" in plots:
        doc["comparison_plots"] = {k: os.path.relpath(v, out_dir) for k, v in plots[""].items()}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=2)
        f.write("\n")
    for r in runs:
        for name, path in plots[r.run_id].items():
            paths[f"{r.run_id}:{name}"] = path
    return paths


def new_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="gpu-energy-exporter report",
        description="Per-run report (Markdown + self-contained HTML) with PNG plots of power, energy per step, "
                    "loss against energy, memory and throughput, and the final energy summary. Several runs "
                    "give a comparison report.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""RUN is a run id (read from --url or --prometheus) or the path of a JSON summary the run ledger
wrote (runs/<run id>.json beside the exporter's --runs.csv).
examples:
  gpu-energy-exporter report demo-20250101-120000-unsloth                  from the exporter on this machine
  gpu-energy-exporter report RUN_A RUN_B --out bnb-vs-unsloth               comparison report
  gpu-energy-exporter report ~/gpu-runs/runs/my-run.json                   from the ledger's JSON summary
  gpu-energy-exporter report my-run --prometheus http://prometheus:9090 --since 30d
""")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run id(s) or ledger JSON summary file(s)")
    add_client_flags(parser)
    parser.add_argument("--prometheus", default=None, metavar="URL",
                        help="read the runs from this Prometheus server instead of the exporter "
                             "(--user/--password-file/--ca-file/--insecure apply to it)")
    parser.add_argument("--since", default="7d", metavar="DURATION",
                        help="with --prometheus: how far back to look for the runs (default: 7d)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output directory (default: report-<run id> or report-comparison-<time>)")
    return parser


def main(argv: list[str], *, stderr: IO[str] | None = None, stdout: IO[str] | None = None) -> int:
    err = stderr if stderr is not None else sys.stderr
    out = stdout if stdout is not None else sys.stdout
    try:
        args = new_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)

    def progress(message: str) -> None:
        print(f"report: {message}", file=err, flush=True)

    try:
        since = parse_duration(args.since)
    except ValueError as exc:
        print(f"gpu-energy-exporter report: error: --since {args.since!r} {exc}", file=err)
        return 2
    try:
        if args.prometheus and args.url:
            raise ReportError("give either --url (the exporter) or --prometheus, not both")
        _matplotlib()  # fail before any network work when the extra is missing
        runs: list[RunData] = []
        client: ExporterClient | None = None
        for i, item in enumerate(args.runs, 1):
            if item.endswith(".json") and os.path.exists(item):
                progress(f"reading {item} ({i}/{len(args.runs)})")
                runs.append(load_file(item))
                continue
            if client is None:
                if args.prometheus:
                    args.url = args.prometheus
                client = client_from_args(args, timeout=30.0)
            if args.prometheus:
                runs.append(PrometheusSource(client, since=since, progress=progress).load(item))
            else:
                progress(f"fetching run {item} from {client.base_url} ({i}/{len(args.runs)})")
                runs.append(load_from_exporter(client, item))
        out_dir = args.out or ("report-" + safe_name(runs[0].run_id) if len(runs) == 1
                               else time.strftime("report-comparison-%Y%m%d-%H%M%S"))
        paths = write_report(runs, out_dir, progress)
    except (ReportError, ExporterUnreachable) as exc:
        print(f"gpu-energy-exporter report: error: {exc}", file=err)
        return 2
    out.write(f"wrote {paths['markdown']}\n      {paths['html']} (self-contained)\n      {paths['json']}\n")
    for r in runs:
        s = r.summary
        out.write(f"{r.run_id}: {fmt_energy(_num(s.get('energy_j')))}, {fmt_num(_num(s.get('j_per_token')))} J/token, "
                  f"{fmt_num(_num(s.get('tokens_per_s')))} tokens/s, CO2 {fmt_co2(_num(s.get('co2_g')))}"
                  + ("  [SIMULATED DATA]" if r.simulated else "") + "\n")
    return 0


__all__ = [
    "PLOTS", "PLOT_DPI", "PLOT_SIZE_IN", "PrometheusSource", "ReportError", "RunData", "energy_per_step",
    "from_ledger_document", "load_file", "load_from_exporter", "loss_vs_energy", "main", "summary_rows",
    "tokens_per_second", "write_report",
]
