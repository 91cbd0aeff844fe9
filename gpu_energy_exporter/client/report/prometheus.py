"""The Prometheus source of ``gpu-energy-exporter report``: one run read back from a Prometheus server that
scraped the exporter, over its HTTP API (``/api/v1/query`` and ``/api/v1/query_range``) through the one
HTTP client (``client/api.py``).

The run's time span comes from the ledger's ``gpuenergy_run_*`` series (else from
``training_run_finished``), its GPUs and metadata from the training contract's info series; then
``query_range`` over the span for the ``gpuenergy_gpu_*`` and ``training_*`` series of the run's GPUs and
exporter instance, on one grid. The summary takes the ledger's own figures where Prometheus has them, else
computes them from the samples (and says so in the run's notes). Training metric and label names come
from ``core/contract.py``, never retyped.

``whole_runs`` lists every run the ledgers served, summed over the nodes that served it (``runs
--prometheus``): a multi-node run whole, where one exporter's ledger sees its own node's ranks only.

This module only reads from Prometheus: it never plots, never formats a report, never writes a file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from gpu_energy_exporter.client.api import ExporterClient, ExporterUnreachable
from gpu_energy_exporter.client.fmt import fmt_duration
from gpu_energy_exporter.client.report.run import ReportError, RunData
from gpu_energy_exporter.core import runs_schema
from gpu_energy_exporter.core.contract import (
    ATTR_GPU_UUID,
    ATTR_RANK,
    ATTR_RUN_ID,
    GPU_NONE,
    GPU_UNKNOWN,
    LOSS,
    RUN_FINISHED,
    RUN_GPU_INFO,
    RUN_INFO,
    STEPS,
    TOKENS,
)


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _uuid_regex(uuids: Sequence[str]) -> str:
    return "|".join(re.escape(u).replace("\\", "\\\\").replace('"', '\\"') for u in uuids)


def _of_run(name: str, rid: str) -> str:
    """The selector of a run's series: ``name{run_id="rid"}`` (``rid`` already escaped)."""
    return f'{name}{{{ATTR_RUN_ID}="{rid}"}}'


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
        raw = self.instant(f"{_of_run(duration, rid)}[{self._window()}]")
        if raw:
            # The ledger's duration at each scrape: start = scrape time - duration, exact to the ledger.
            samples = [(float(ts), float(v)) for s in raw for ts, v in s["values"]]
            first_ts, first_v = min(samples)
            start = first_ts - first_v
            end = start + max(v for _, v in samples)
            return start, end, f"the run ledger's {duration}", dict(raw[0]["metric"])
        raw = self.instant(f"{_of_run(RUN_FINISHED.prometheus, rid)}[{self._window()}]")
        if not raw:
            raise ReportError(
                f"run {run_id!r} not found in Prometheus at {self.client.base_url} over the last "
                f"{fmt_duration(self.since)} (no {_ledger_name('RUN_DURATION')} or {RUN_FINISHED.prometheus} "
                f"series with that {ATTR_RUN_ID}): is Prometheus scraping the exporter, and is the run id right? For "
                "older runs pass --since")
        start = min(float(s["values"][0][0]) for s in raw)
        ends = []
        for s in raw:
            done = [float(ts) for ts, v in s["values"] if float(v) >= 1]
            ends.append(min(done) if done else float(s["values"][-1][0]))
        return start, max(ends), f"{RUN_FINISHED.prometheus} (to the scrape interval)", dict(raw[0]["metric"])

    def load(self, run_id: str) -> RunData:
        self.progress(f"finding run {run_id} in Prometheus")
        start, end, how, labels = self.span(run_id)
        rid = _label_value(run_id)
        instance = labels.get("instance")
        inst = f', instance="{_label_value(instance)}"' if instance else ""
        window = self._window()
        # The run's GPUs and metadata.
        uuids: list[str] = []
        for expr in (_of_run(RUN_GPU_INFO.prometheus, rid), _of_run(_ledger_name("RUN_INFO"), rid),
                     _of_run(TOKENS.prometheus, rid)):
            for s in self.instant(f"last_over_time({expr}[{window}])"):
                for u in s["metric"].get(ATTR_GPU_UUID, "").split(","):
                    u = u.strip()
                    if u and u.lower() not in (GPU_NONE, GPU_UNKNOWN) and u not in uuids:
                        uuids.append(u)
            if uuids:
                break
        meta: dict[str, Any] = {}
        for s in self.instant(f"last_over_time({_of_run(RUN_INFO.prometheus, rid)}[{window}])"):
            if not meta or s["metric"].get(ATTR_RANK) == "0":
                meta = {k: v for k, v in s["metric"].items()
                        if k not in ("__name__", ATTR_RUN_ID, ATTR_RANK, ATTR_GPU_UUID, "instance", "job")}
        span = max(1.0, end - start)
        step = max(1.0, math.ceil(span / self.max_points))
        # One point before the start: counters there are the baseline.
        lo = round(start - step, 3)
        n = int(math.ceil((end - lo) / step)) + 1
        hi = lo + (n - 1) * step
        grid = [lo + i * step for i in range(n)]
        run = RunData(run_id=run_id, source=f"Prometheus {self.client.base_url}", summary={}, start=start, end=end)
        run.notes.append(f"time span from {how}; series sampled every {step:g}s by query_range")
        sel = f'{ATTR_GPU_UUID}=~"{_uuid_regex(uuids)}"{inst}' if uuids else None

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
                names[s["metric"].get(ATTR_GPU_UUID, "")] = s["metric"].get("model", "")
            for s in series(f"gpuenergy_gpu_power_watts{{{sel}}}"):
                power[s["metric"].get(ATTR_GPU_UUID, "")] = on_grid(s["values"])
        tick("GPU power")
        energy = aligned(series(f"sum(gpuenergy_gpu_energy_joules_total{{{sel}}})")) if sel else [None] * len(grid)
        tick("GPU energy")
        tokens = aligned(series(f"sum({_of_run(TOKENS.prometheus, rid)})"))
        tick("tokens")
        steps = aligned(series(f"max({_of_run(STEPS.prometheus, rid)})"))
        tick("steps")
        loss_series = series(_of_run(LOSS.prometheus, rid))
        loss_series.sort(key=lambda s: _rank_key(s["metric"].get(ATTR_RANK, "")))
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
        nodes = 0
        for key, name in _ledger_series().items():
            result = self.instant(f"last_over_time({_of_run(name, rid)}[{self._window()}])")
            values = [v for v in (_finite(float(r["value"][1])) for r in result) if v is not None]
            nodes = max(nodes, len({(r["metric"].get("instance"), r["metric"].get("job")) for r in result}))
            if len(values) == 1:
                summary[key] = values[0]
                found += 1
            elif values and key in _NODE_SUMS:
                # A multi-node run: each node's ledger has its own GPUs' energy and its own ranks' tokens.
                summary[key] = sum(values)
                found += 1
            elif values and key in _NODE_MAX:
                summary[key] = max(values)
                found += 1
            elif values:
                summary[key] = None  # a per-node ratio (J/token): made from the sums below
        if nodes > 1:
            whole = whole_runs(self, run.run_id)
            if whole:
                summary["j_per_token"] = whole[0]["j_per_token"]
            run.notes.append(f"summary figures summed over the {nodes} exporters whose ledgers served the run "
                             "(peak power: the sum of each node's peak, an upper bound); the plots show the GPUs "
                             "of one of them")
        info = self.instant(f'last_over_time({_of_run(_ledger_name("RUN_INFO"), rid)}[{self._window()}])')
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
    "dynamic_energy_j": "RUN_DYNAMIC_ENERGY", "mfu": "RUN_MFU",
}


#: Ledger figures that add up over the nodes of a multi-node run, and those whose highest node is the run's.
_NODE_SUMS = frozenset({"energy_j", "tokens", "tokens_per_s", "avg_power_w", "peak_power_w", "co2_g",
                        "dynamic_energy_j"})
_NODE_MAX = frozenset({"steps", "duration_s", "vram_peak_bytes"})


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
# whole runs (``runs --prometheus``)

#: Ledger counters summed over nodes for a whole run: summary key -> spec name in ``core/runs_schema``.
_WHOLE_SUMS = {
    "energy_j": "RUN_ENERGY", "tokens": "RUN_TOKENS", "co2_g": "RUN_CO2", "window_energy_j": "RUN_WINDOW_ENERGY",
    "window_tokens": "RUN_WINDOW_TOKENS", "tokens_per_s": "RUN_TOKENS_PER_SECOND", "avg_power_w": "RUN_AVERAGE_POWER",
}


def whole_runs(source: PrometheusSource, run_id: str | None = None) -> list[dict[str, Any]]:
    """Every run (or only ``run_id``) the run ledgers served in the last ``source.since``, summed over the
    exporters (nodes) that served it, as rows of the runs table (``core.runs_schema`` column names, plus ``nodes`` and
    ``ranks_scope``). Each node's ledger counts its own GPUs' energy and the tokens of its own ranks, so
    the sums are the whole run's: energy, tokens, CO2; J/token is the post-warm-up energy over the
    post-warm-up tokens of every node (the ledgers' own J/token, whole run); tokens/s and average power add
    up over nodes (they run at the same time); VRAM peak is the highest node's; duration the longest.
    ``ranks`` counts the distinct ranks whose training series Prometheus has, against ``world_size``."""
    w = source._window()
    only = f'{{{ATTR_RUN_ID}="{_label_value(run_id)}"}}' if run_id is not None else ""

    def last(spec: str) -> str:
        return f"last_over_time({_ledger_name(spec)}{only}[{w}])"

    def by_run(expr: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in source.instant(expr):
            rid = s["metric"].get(ATTR_RUN_ID)
            value = _finite(float(s["value"][1]))
            if rid is not None and value is not None:
                out[rid] = value
        return out

    def node_sum(spec: str) -> dict[str, float]:
        # Per node: summed over the series of one scrape target, the max over the jobs that scrape it.
        return by_run(f"sum by ({ATTR_RUN_ID}) (max by ({ATTR_RUN_ID}, instance) "
                      f"(sum by ({ATTR_RUN_ID}, instance, job) ({last(spec)})))")

    sums = {key: node_sum(spec) for key, spec in _WHOLE_SUMS.items()}
    steps = by_run(f"max by ({ATTR_RUN_ID}) ({last('RUN_STEPS')})")
    duration = by_run(f"max by ({ATTR_RUN_ID}) ({last('RUN_DURATION')})")
    vram = by_run(f"max by ({ATTR_RUN_ID}) ({last('RUN_MEMORY_PEAK')})")
    nodes = by_run(f"count by ({ATTR_RUN_ID}) (count by ({ATTR_RUN_ID}, instance) ({last('RUN_ENERGY')}))")
    # The start: the scrape time minus the ledger's duration, the earliest over the window (5-minute steps).
    starts = by_run(f"min by ({ATTR_RUN_ID}) (min_over_time((time() - {_ledger_name('RUN_DURATION')}{only})"
                    f"[{w}:5m]))")
    ranks = by_run(f"count by ({ATTR_RUN_ID}) (count by ({ATTR_RUN_ID}, {ATTR_RANK}) "
                   f"(last_over_time({TOKENS.prometheus}{only}[{w}])))")
    info: dict[str, dict[str, str]] = {}
    for s in source.instant(f"last_over_time({_ledger_name('RUN_INFO')}{only}[{w}])"):
        m = s["metric"]
        rid = m.get(ATTR_RUN_ID)
        if rid is None:
            continue
        row = info.setdefault(rid, {})
        # A node still running the run wins over one that closed it.
        if not row or m.get("status") in ("running", "finishing"):
            row.update({k: v for k, v in m.items() if k not in ("__name__", "instance", "job", ATTR_GPU_UUID)})
        uuids = [u for u in (row.get("_uuids", "") + "," + m.get(ATTR_GPU_UUID, "")).split(",") if u]
        row["_uuids"] = ",".join(dict.fromkeys(uuids))
    world: dict[str, str] = {}
    for s in source.instant(f"max by ({ATTR_RUN_ID}, world_size) (last_over_time({RUN_INFO.prometheus}{only}[{w}]))"):
        rid, size = s["metric"].get(ATTR_RUN_ID), s["metric"].get("world_size")
        if rid is not None and size:
            world[rid] = size
    out: list[dict[str, Any]] = []
    for rid in sorted(set(sums["energy_j"]) | set(info), key=lambda r: starts.get(r, math.inf)):
        meta = info.get(rid, {})
        energy = sums["energy_j"].get(rid)
        win_e, win_t = sums["window_energy_j"].get(rid), sums["window_tokens"].get(rid)
        if win_e is None or win_t is None:  # exporters older than the window counters: the whole run
            win_e, win_t = energy, sums["tokens"].get(rid)
        start = starts.get(rid)
        uuids = [u for u in meta.get("_uuids", "").split(",") if u]
        out.append({
            ATTR_RUN_ID: rid, "status": meta.get("status"),
            "start_time": _iso(start) if start is not None else None, "duration_s": duration.get(rid),
            **{k: meta.get(k) for k in ("model", "backend", "optimizer", "precision")},
            "world_size": world.get(rid), "ranks": ranks.get(rid), "ranks_scope": "in Prometheus",
            "nodes": nodes.get(rid), "gpu_count": len(uuids) or None, "gpu_uuids": " ".join(uuids),
            "tokens": sums["tokens"].get(rid), "tokens_local": sums["tokens"].get(rid), "steps": steps.get(rid),
            "window_tokens": win_t, "window_energy_j": win_e,
            "tokens_per_s": sums["tokens_per_s"].get(rid),
            "j_per_token": win_e / win_t if win_e is not None and win_t else None,
            "energy_j": energy, "energy_kwh": energy / 3.6e6 if energy is not None else None,
            "avg_power_w": sums["avg_power_w"].get(rid), "peak_power_w": None, "vram_peak_bytes": vram.get(rid),
            "co2_g": sums["co2_g"].get(rid),
        })
    return out


def _iso(t: float) -> str:
    """Unix time as the ledger writes it (ISO 8601, UTC, milliseconds)."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
