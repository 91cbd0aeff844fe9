"""The run ledger's series on /metrics: its self-metrics, which summary figure each per-run series serves,
and the families one collection is made of.

The per-run series themselves (``gpuenergy_run_*``) are declared in ``core.runs_schema``, beside the CSV
columns, because the workstation commands read them back; the ledger's own health series are declared here.
Everything here works on plain values (summaries, counts): it never takes the ledger's lock, never reads
a snapshot and never computes a figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    RUN_PROVISIONAL_ENERGY,
    RUN_REMOTE_TOKENS,
    RUN_SAMPLES,
    RUN_STEPS,
    RUN_TOKEN_COVERAGE,
    RUN_TOKENS,
    RUN_TOKENS_PER_SECOND,
    RUN_WINDOW_ENERGY,
    RUN_WINDOW_TOKENS,
)
from gpu_energy_exporter.ledger.process_claims import REFUSED_REASONS
from gpu_energy_exporter.ledger.snapshot_frames import Frame
from gpu_energy_exporter.ledger.split import UNCONFIRMED_REASONS, Holding

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
    "Finished runs not yet written to the runs CSV or the database (the write backlog): kept, written by the "
    "ledger's threads; grows while the file system is slow, stalled or failing (failed writes are retried with "
    "back-off).", collector=COLLECTOR)
LEDGER_WRITE_BACKLOG = metrics.define(
    "ledger", "write_backlog_seconds", "gauge",
    "How long the oldest finished run not yet written to the runs CSV has waited (0 when none waits).",
    collector=COLLECTOR, unit="seconds")
LEDGER_STATE_LOST = metrics.define(
    "ledger", "state_lost_total", "counter",
    "Saved ledger state that could not be restored, by reason: damaged_record (a run's or row's record in the "
    "database did not decode: one per record), damaged_database (the database could not be read: moved aside), "
    "migration_failed (a previous release's journal, or part of it, could not be migrated), refused (the state "
    "directory or database is not the exporter's user's own or is writable by others: runs kept in memory). The "
    "log names the runs lost and for how long; their rows say so.", ("reason",), collector=COLLECTOR)
LEDGER_UNATTRIBUTED = metrics.define(
    "ledger", "unattributed_energy_joules_total", "counter",
    "Energy of a GPU charged to no run (no run used it then), counted once no late point can change that: "
    "--runs.stale-after + 120 s after the fact. Per GPU, runs' energy + this = the GPU's energy.",
    metrics.GPU_LABELS, collector=COLLECTOR, unit="joules")

LEDGER_UNCONFIRMED_CLAIMS = metrics.define(
    "ledger", "unconfirmed_claims_total", "counter",
    "GPUs runs named but were not charged for, past --runs.claim-grace, because NVML listed none of the run's "
    "processes there (reason no_process) or the run never sent its process.pid (no_pid); counted once per run "
    "and GPU. Their energy stays the GPU's unattributed energy.", ("reason",), collector=COLLECTOR)
LEDGER_PROCESSES = metrics.define(
    "ledger", "gpu_processes", "gauge",
    "Compute processes NVML listed on the GPU at the last snapshot, by owner: run (one of a run's own "
    "processes), pod (no run's, in a Kubernetes pod: its energy is on the pod series) or no_run (neither). "
    "Processes that are no run's keep their share of the GPU, as the ledger's unattributed energy. Absent "
    "where the process list or the host's process table is not available.",
    (*metrics.GPU_LABELS, "owner"), collector=COLLECTOR)
LEDGER_REFUSED_PROCESSES = metrics.define(
    "ledger", "refused_processes_total", "counter",
    "Points refused because the process pushing them under an existing run id is not one of the run's: its "
    "job identity disagrees (job_mismatch), the run's world size is full (world_size), or another live process "
    "pushes that rank (rank_taken).", ("reason",), collector=COLLECTOR)
LEDGER_POINTS_REFUSED = metrics.define(
    "ledger", "points_refused_total", "counter",
    "Points the ledger did not let change a run, by reason: not from the client the run's rank belongs to "
    "(not_run_owner), a new rank or a continuation from another node (foreign_rank, not_run_client), over a "
    "per-client bound (client_active_runs, client_new_runs, client_finished_runs; --runs.max-*-per-client). "
    "See docs/ledger.md.", ("reason",), collector=COLLECTOR)

STATUSES = ("finished", "stale", "exporter_stopped")

#: What ``ClaimTally.counts`` gives ``families``: unconfirmed claims and refused processes by reason, and the
#: listed processes by (gpu, gpu_uuid, owner).
Claims = tuple[Mapping[str, float], Mapping[str, float], Mapping[tuple[str, str, str], float]]


class ClaimTally:
    """Counts of refused processes and of closed runs' unconfirmed GPU claims, by reason (the ledger's
    lock held)."""

    def __init__(self) -> None:
        self.refused: dict[str, float] = dict.fromkeys(REFUSED_REASONS, 0.0)
        self.unconfirmed: dict[str, float] = dict.fromkeys(UNCONFIRMED_REASONS, 0.0)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0.0) + 1

    def closed(self, reasons: Iterable[str]) -> None:
        for reason in reasons:
            self.unconfirmed[reason] = self.unconfirmed.get(reason, 0.0) + 1

    def counts(self, active: Iterable[Iterable[str]], latest: Frame | None = None,
               holders: Callable[[Frame], Mapping[str, Sequence[Holding]]] | None = None) -> Claims:
        """(unconfirmed claims by reason, closed runs' and ``active`` runs' reasons; refused by reason;
        (gpu, gpu_uuid, owner) -> processes NVML listed in the ``latest`` frame, by whether they are a run's)."""
        unconfirmed = dict(self.unconfirmed)
        for reasons in active:
            for reason in reasons:
                unconfirmed[reason] = unconfirmed.get(reason, 0.0) + 1
        listed: dict[tuple[str, str, str], float] = {}
        if latest is not None and holders is not None:
            held = holders(latest)
            for key, g in latest.gpus.items():
                if g.procs is None:
                    continue  # not known: no series rather than a wrong 0
                owned = {pid for h in held.get(key, ()) if h.start <= latest.t <= h.end for pid in h.pids}
                runs_n = sum(1 for p in g.procs if p.pid in owned)
                pods_n = sum(1 for p in g.procs if p.pid not in owned and p.host is not None and p.host.pod_uid)
                listed[(str(g.index), g.uuid, "run")] = float(runs_n)
                listed[(str(g.index), g.uuid, "pod")] = float(pods_n)
                listed[(str(g.index), g.uuid, "no_run")] = float(len(g.procs) - runs_n - pods_n)
        return unconfirmed, dict(self.refused), listed

#: The per-run counters on /metrics and the summary figure each one serves (``counter_values``).
COUNTER_COLUMNS = (
    (RUN_ENERGY, "energy_j"), (RUN_TOKENS, "tokens_local"), (RUN_REMOTE_TOKENS, "tokens_remote"),
    (RUN_STEPS, "steps"), (RUN_SAMPLES, "samples"), (RUN_FLOPS, "flops"), (RUN_ACTIVE_SECONDS, "duration_s"),
    (RUN_CO2, "co2_g"),
)

#: The efficiency window's counters and the summary figure each one serves once the warm-up is over.
WINDOW_COLUMNS = ((RUN_WINDOW_ENERGY, "window_energy_j"), (RUN_WINDOW_TOKENS, "window_tokens"))

#: The per-run gauges on /metrics and the summary figure each one serves (absent while it is None).
GAUGE_COLUMNS = (
    (RUN_DURATION, "duration_s"), (RUN_DYNAMIC_ENERGY, "dynamic_energy_j"), (RUN_TOKENS_PER_SECOND, "tokens_per_s"),
    (RUN_JOULES_PER_TOKEN, "j_per_token"), (RUN_AVERAGE_POWER, "avg_power_w"), (RUN_PEAK_POWER, "peak_power_w"),
    (RUN_MEMORY_PEAK, "vram_peak_bytes"), (RUN_TOKEN_COVERAGE, "token_coverage"),
    (RUN_PEAK_FLOPS, "peak_flops_per_s"), (RUN_MFU, "mfu"), (RUN_PROVISIONAL_ENERGY, "energy_provisional_j"),
)

#: The per-run families, in the order /metrics serves them.
RUN_SERIES = (
    RUN_ACTIVE, RUN_INFO, RUN_DURATION, RUN_ENERGY, RUN_PROVISIONAL_ENERGY, RUN_DYNAMIC_ENERGY, RUN_TOKENS,
    RUN_STEPS, RUN_SAMPLES,
    RUN_FLOPS, RUN_ACTIVE_SECONDS, RUN_TOKENS_PER_SECOND, RUN_JOULES_PER_TOKEN, RUN_AVERAGE_POWER,
    RUN_PEAK_POWER, RUN_MEMORY_PEAK, RUN_CO2, RUN_REMOTE_TOKENS, RUN_TOKEN_COVERAGE, RUN_PEAK_FLOPS, RUN_MFU,
    RUN_WINDOW_ENERGY, RUN_WINDOW_TOKENS,
)


def counter_values(exposed: dict[str, float], summary: Mapping[str, Any], warmup_s: float = 0.0
                   ) -> dict[str, float]:
    """A run's counters as served: the summary's figures, never below what was served before (``exposed``:
    counter name -> highest value served for the run, updated here).

    The figures can go down: closing a run whose end became known late (a stale run, a late finish
    point) replays the snapshots only up to the end, and a rank's counter can restart. Prometheus
    would read a decrease as a reset and count the whole value again as an increase, a spike in every
    rate. So the served value holds the highest one served (for a run closed late it stays above the
    summary's ``energy_j`` by the energy counted after the end: at most ``stale_after`` of the GPUs'
    energy, seen in one rate window; likewise the active seconds, which hold the time until the run was
    found stale, a period with no tokens that throughput then averages in).

    ``warmup_s``: the configured warm-up. The window counters stay at 0 while the summary's window is the
    whole run because the run is still shorter than the warm-up (its ``warmup_s`` is 0 then): they count
    only what comes after the warm-up, so they never jump back when the window moves past it."""
    out: dict[str, float] = {}
    in_warmup = warmup_s > 0 and not summary.get("warmup_s")
    columns = (*COUNTER_COLUMNS, *WINDOW_COLUMNS)
    for spec, key in columns:
        value = summary.get(key)
        if in_warmup and (spec, key) in WINDOW_COLUMNS and value is not None:
            value = 0.0
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


def state_lost_family(counts: Mapping[str, float]) -> Metric:
    """``gpuenergy_ledger_state_lost_total`` by reason (every reason, from zero)."""
    fam = LEDGER_STATE_LOST.family()
    for reason in sorted(counts):
        metrics.add(fam, [reason], counts[reason])
    return fam


def families(runs: Iterable[ServedRun], finished: Mapping[str, float], rejected: float, errors: float,
             evicted: float, pending: int, unattributed: Sequence[tuple[str, str, float]],
             backlog_s: float = 0.0, claims: Claims = ({}, {}, {})) -> list[Metric]:
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
    backlog = LEDGER_WRITE_BACKLOG.family()
    metrics.add(backlog, [], backlog_s)
    free = LEDGER_UNATTRIBUTED.family()
    for index, uuid, joules in unattributed:
        metrics.add(free, [index, uuid], joules)
    unconfirmed, refused = LEDGER_UNCONFIRMED_CLAIMS.family(), LEDGER_REFUSED_PROCESSES.family()
    for fam, counts in ((unconfirmed, claims[0]), (refused, claims[1])):
        for reason in sorted(counts):
            metrics.add(fam, [reason], counts[reason])
    procs = LEDGER_PROCESSES.family()
    for labels in sorted(claims[2], key=lambda x: (len(x[0]), x)):
        metrics.add(procs, list(labels), claims[2][labels])
    return [*fams.values(), done, rej, err, ev, pend, backlog, free, unconfirmed, refused, procs]
