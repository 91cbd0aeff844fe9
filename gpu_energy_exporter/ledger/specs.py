"""The run ledger's series on /metrics: its self-metrics, which summary figure each per-run series serves,
and the families one collection is made of.

The per-run series themselves (``gpuenergy_run_*``) are declared in ``core.runs_schema``, beside the CSV
columns, because the workstation commands read them back; the ledger's own health series are declared here.
Everything here works on plain values (summaries, counts): it never takes the ledger's lock, never reads
a snapshot and never computes a figure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.runs_schema import (
    COLLECTOR,
    RUN_ACTIVE,
    RUN_ACTIVE_SECONDS,
    RUN_AVERAGE_POWER,
    RUN_CO2,
    RUN_DURATION,
    RUN_DYNAMIC_ENERGY,
    RUN_ENERGY,
    RUN_FLOPS,
    RUN_INFO,
    RUN_JOULES_PER_TOKEN,
    RUN_MEMORY_PEAK,
    RUN_MFU,
    RUN_PEAK_FLOPS,
    RUN_PEAK_POWER,
    RUN_REMOTE_TOKENS,
    RUN_SAMPLES,
    RUN_STEPS,
    RUN_TOKEN_COVERAGE,
    RUN_TOKENS,
    RUN_TOKENS_PER_SECOND,
)

LEDGER_RUNS_FINISHED = metrics.define(
    "ledger", "runs_finished_total", "counter",
    "Runs the ledger closed, by status (finished, stale, exporter_stopped).", ("status",),
    collector=COLLECTOR)
LEDGER_RUNS_REJECTED = metrics.define(
    "ledger", "runs_rejected_total", "counter",
    "Points of new runs ignored because the ledger already tracked its maximum of active runs.",
    collector=COLLECTOR)
LEDGER_RUNS_EVICTED = metrics.define(
    "ledger", "runs_evicted_total", "counter",
    "Run ids dropped before they pushed any training progress, to make room for new runs.",
    collector=COLLECTOR)
LEDGER_WRITE_ERRORS = metrics.define(
    "ledger", "write_errors_total", "counter",
    "Failed writes of the runs CSV or a JSON summary (the run is kept and retried; see the log).",
    collector=COLLECTOR)
LEDGER_WRITES_PENDING = metrics.define(
    "ledger", "writes_pending", "gauge",
    "Finished runs not yet written to the runs CSV because writing failed; retried with back-off and at "
    "shutdown.", collector=COLLECTOR)
LEDGER_UNATTRIBUTED = metrics.define(
    "ledger", "unattributed_energy_joules_total", "counter",
    "Energy of a GPU charged to no run (no run used it then), counted once no late point can change that: "
    "--runs.stale-after + 120 s after the fact. Per GPU, runs' energy + this = the GPU's energy.",
    metrics.GPU_LABELS, collector=COLLECTOR, unit="joules")

LEDGER_POINTS_REFUSED = metrics.define(
    "ledger", "points_refused_total", "counter",
    "Points the ledger did not let change a run, by reason: not from the client the run's rank belongs to "
    "(not_run_owner), a new rank or a continuation from another node (foreign_rank, not_run_client), over a "
    "per-client bound (client_active_runs, client_new_runs, client_finished_runs; --runs.max-*-per-client). "
    "See docs/ledger.md.", ("reason",), collector=COLLECTOR)

STATUSES = ("finished", "stale", "exporter_stopped")

#: The per-run counters on /metrics and the summary figure each one serves (``counter_values``).
COUNTER_COLUMNS = (
    (RUN_ENERGY, "energy_j"), (RUN_TOKENS, "tokens_local"), (RUN_REMOTE_TOKENS, "tokens_remote"),
    (RUN_STEPS, "steps"), (RUN_SAMPLES, "samples"), (RUN_FLOPS, "flops"), (RUN_ACTIVE_SECONDS, "duration_s"),
)

#: The per-run gauges on /metrics and the summary figure each one serves (absent while it is None).
GAUGE_COLUMNS = (
    (RUN_DURATION, "duration_s"), (RUN_DYNAMIC_ENERGY, "dynamic_energy_j"), (RUN_TOKENS_PER_SECOND, "tokens_per_s"),
    (RUN_JOULES_PER_TOKEN, "j_per_token"), (RUN_AVERAGE_POWER, "avg_power_w"), (RUN_PEAK_POWER, "peak_power_w"),
    (RUN_MEMORY_PEAK, "vram_peak_bytes"), (RUN_CO2, "co2_g"), (RUN_TOKEN_COVERAGE, "token_coverage"),
    (RUN_PEAK_FLOPS, "peak_flops_per_s"), (RUN_MFU, "mfu"),
)

#: The per-run families, in the order /metrics serves them.
RUN_SERIES = (
    RUN_ACTIVE, RUN_INFO, RUN_DURATION, RUN_ENERGY, RUN_DYNAMIC_ENERGY, RUN_TOKENS, RUN_STEPS, RUN_SAMPLES,
    RUN_FLOPS, RUN_ACTIVE_SECONDS, RUN_TOKENS_PER_SECOND, RUN_JOULES_PER_TOKEN, RUN_AVERAGE_POWER,
    RUN_PEAK_POWER, RUN_MEMORY_PEAK, RUN_CO2, RUN_REMOTE_TOKENS, RUN_TOKEN_COVERAGE, RUN_PEAK_FLOPS, RUN_MFU,
)


def counter_values(exposed: dict[str, float], summary: Mapping[str, Any]) -> dict[str, float]:
    """A run's counters as served: the summary's figures, never below what was served before (``exposed``:
    counter name -> highest value served for the run, updated here).

    The figures can go down: closing a run whose end became known late (a stale run, a late finish
    point) replays the snapshots only up to the end, and a rank's counter can restart. Prometheus
    would read a decrease as a reset and count the whole value again as an increase, a spike in every
    rate. So the served value holds the highest one served (for a run closed late it stays above the
    summary's ``energy_j`` by the energy counted after the end: at most ``stale_after`` of the GPUs'
    energy, seen in one rate window; likewise the active seconds, which hold the time until the run was
    found stale, a period with no tokens that throughput then averages in)."""
    out: dict[str, float] = {}
    for spec, key in COUNTER_COLUMNS:
        value = summary.get(key)
        if value is None or not math.isfinite(value):
            continue
        served = max(float(value), exposed.get(spec.name, 0.0))
        exposed[spec.name] = served
        out[spec.name] = served
    return out


#: One run as served: run id, status, summary, its counters (``counter_values``).
ServedRun = tuple[str, str, Mapping[str, Any], Mapping[str, float]]


def refused_family(refused: Mapping[str, float]) -> Metric:
    """``gpuenergy_ledger_points_refused_total`` by reason (every reason, from zero)."""
    fam = LEDGER_POINTS_REFUSED.family()
    for reason in sorted(refused):
        metrics.add(fam, [reason], refused[reason])
    return fam


def families(runs: Iterable[ServedRun], finished: Mapping[str, float], rejected: float, errors: float,
             evicted: float, pending: int, unattributed: Sequence[tuple[str, str, float]]) -> list[Metric]:
    """The ledger's part of one /metrics collection: per-run series and the ledger's self-metrics."""
    fams = {spec.name: spec.family() for spec in RUN_SERIES}
    for run_id, status, s, counters in runs:
        lab = [run_id]
        metrics.add(fams[RUN_ACTIVE.name], lab, 1.0 if status in ("running", "finishing") else 0.0)
        metrics.add(fams[RUN_INFO.name], [run_id, status, *(s.get(k) or "" for k in (
            "model", "backend", "optimizer", "precision")), ",".join(s["gpu_uuids"].split()),
            s.get("energy_split") or ""], {})
        for name, total in counters.items():
            metrics.add(fams[name], lab, total)
        for spec, key in GAUGE_COLUMNS:
            value = s.get(key)
            if value is not None:
                metrics.add(fams[spec.name], lab, value)
    done = LEDGER_RUNS_FINISHED.family()
    for status in sorted(finished):
        metrics.add(done, [status], finished[status])
    rej = LEDGER_RUNS_REJECTED.family()
    metrics.add(rej, [], rejected)
    err = LEDGER_WRITE_ERRORS.family()
    metrics.add(err, [], errors)
    ev = LEDGER_RUNS_EVICTED.family()
    metrics.add(ev, [], evicted)
    pend = LEDGER_WRITES_PENDING.family()
    metrics.add(pend, [], float(pending))
    free = LEDGER_UNATTRIBUTED.family()
    for index, uuid, joules in unattributed:
        metrics.add(free, [index, uuid], joules)
    return [*fams.values(), done, rej, err, ev, pend, free]
