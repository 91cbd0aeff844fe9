"""A run's figures: the summary document (the CSV row, the JSON summary, ``/api/v1/runs``) made from the
run's state and its accumulator, and the details of ``/api/v1/run``.

Pure: every function takes the run and plain values (the warm-up, which series are local, the peak FLOP/s)
and returns a new dict; nothing here locks, reads a snapshot, a clock or a file, or changes the run. The
column names and what each figure means are ``core.runs_schema.COLUMNS`` (docs/ledger.md).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from gpu_energy_exporter.core.health import XidEvent
from gpu_energy_exporter.core.runs_schema import METADATA_KEYS
from gpu_energy_exporter.ledger import billing
from gpu_energy_exporter.ledger import split as ledger_split
from gpu_energy_exporter.ledger.accounting import Acc
from gpu_energy_exporter.ledger.files import RUNS_DIR, iso_utc, summary_filename
from gpu_energy_exporter.ledger.health_notes import xid_notes
from gpu_energy_exporter.ledger.runs import (
    EPOCH,
    FLOPS,
    HISTOGRAM,
    LEARNING_RATE,
    LOSS,
    SAMPLES,
    STEPS,
    TOKENS,
    VALIDATION_LOSS,
    Run,
    SeriesState,
    rank_order,
)
from gpu_energy_exporter.ledger.snapshot_frames import Frame
from gpu_energy_exporter.reference.gpu_specs import lookup_peak_flops

Local = Callable[[SeriesState], bool]


def summary_path(csv_path: str | None, run_id: str) -> str | None:
    """The usual place of a run's JSON summary, relative to the runs CSV (None without a CSV)."""
    return os.path.join(RUNS_DIR, summary_filename(run_id)) if csv_path is not None else None


def local_check(frame: Frame | None) -> Local:
    """Whether a series comes from a rank whose GPUs this node measures: one of its ``gpu_uuid`` GPUs
    (or MIG instances) is in ``frame``, the latest snapshot. A series naming no GPU counts as local."""

    def local(series: SeriesState) -> bool:
        if frame is None or not series.gpus:
            return True
        return any(k in frame.gpus or k in frame.mig_parent for k in series.gpus)

    return local


@functools.lru_cache(maxsize=256)
def peak_row(model: str) -> dict[str, float]:
    """Peak FLOP/s of a GPU model by precision (the bundled table, looked up once per model)."""
    row = lookup_peak_flops(model)
    return dict(row.flops) if row is not None else {}


def peak_flops(gpus: Mapping[str, str], frame: Frame | None, precision: str,
               rows: Callable[[str], Mapping[str, float]]) -> float | None:
    """Peak FLOP/s of a run's local GPUs (``gpus``: its uuid keys) at ``precision``; a MIG instance counts
    its share of the parent's SMs (NVML's instance attributes), or 1 / (instances on its parent) where the
    driver does not say. ``rows``: GPU model -> precision -> peak FLOP/s. None when any local GPU's model or
    the precision has no figure."""
    if frame is None or not precision:
        return None
    per_parent: dict[str, int] = {}
    for parent in frame.mig_parent.values():
        per_parent[parent] = per_parent.get(parent, 0) + 1
    share: dict[str, float] = {}
    for key in gpus:
        parent = frame.mig_parent.get(key, key)
        if parent not in frame.gpus:
            continue
        sm_share = frame.mig_profile.get(key, (1, None))[1]
        part = (sm_share if sm_share is not None else 1.0 / per_parent[parent]) if parent != key else 1.0
        share[parent] = min(1.0, share.get(parent, 0.0) + part)
    if not share:
        return None
    total = 0.0
    for parent, part in share.items():
        value = rows(frame.gpus[parent].name).get(precision)
        if not value:
            return None
        total += value * part
    return total


def _counter_at(run: Run, t: float, name: str, local: Local | None = None) -> float | None:
    return run.counter_at(name, t, local)


def summarize(run: Run, acc: Acc, *, warmup_s: float, local: Local, carbon_configured: bool,
              peak: float | None, summary_file: str | None, xids: Sequence[XidEvent] = (),
              as_of: float | None = None) -> dict[str, Any]:
    """The run's summary, as of ``acc`` (``acc.t`` is the end of a run still going). ``peak``: the run's
    peak FLOP/s (``peak_flops``); ``carbon_configured``: a carbon source was given (a run with no energy
    then has 0 g CO2 rather than none); ``xids``: the recent critical Xids (a note names those of the run's
    GPUs while it ran); ``as_of``: the counters (tokens, samples, steps, FLOPs) as they stood then (``acc``
    cut there too), else their latest values. Each figure is made by its rule in ``billing``."""
    counter = run.counter if as_of is None else functools.partial(_counter_at, run, as_of)
    end = acc.t if run.e is None else run.e
    win = billing.efficiency_window(max(0.0, end - run.s), warmup_s)
    counts = _counts(run, counter, local, win.applied)
    energy = _energy(run, acc, win.applied)
    carbon = billing.carbon_figures(acc.co2_g, acc.carbon_kwh, acc.carbon_weighted_intensity,
                                    acc.carbon_weighted_pue, measured=energy.measured, energy_j=acc.energy_j,
                                    configured=carbon_configured)
    missing = [k for k in run.gpus if k not in run.resolved]
    notes = list(run.notes)
    if warmup_s > 0 and not win.applied:
        notes.append(f"run shorter than the warm-up ({warmup_s:g}s): efficiency figures cover the whole run")
    notes += _run_notes(run, acc, local, counts, end, xids)
    notes += _energy_notes(run, acc, energy, missing)
    out: dict[str, Any] = {
        **_run_part(run, end, win, missing),
        **_efficiency_part(counts, win, energy),
        **_energy_part(run, acc, energy, win, counts.window_flops, peak, carbon),
        **_training_part(run, counts, energy, win),
        "energy_coverage": energy.coverage,
        "energy_split": ",".join(sorted(run.splits)),
        "summary_file": summary_file,
        "ledger_notes": "; ".join(notes),
    }
    return _only_finite(out, notes, run.overflowed)


class _Counts(NamedTuple):
    """The run's training counters for its summary (``local``: ranks whose GPUs this node measures)."""

    tokens_all: float | None
    tokens: float | None  # local ranks' (0 when every rank is remote)
    tokens_remote: float | None
    samples: float | None  # local
    steps: float | None  # the highest rank's
    flops: float | None  # local
    window_tokens: float | None  # over the efficiency window
    window_samples: float | None
    window_steps: float | None
    window_flops: float | None


def _counts(run: Run, counter: Callable[..., float | None], local: Local, warmup_applied: bool) -> _Counts:
    """The counters as ``counter`` gives them, and their increases over the efficiency window (their values at
    the warm-up's end are looked up only when the warm-up applies)."""
    tokens_all, tokens = counter(TOKENS), counter(TOKENS, local)
    if tokens is None and tokens_all is not None:
        tokens = 0.0  # every rank is remote
    tokens_remote = counter(TOKENS, lambda x: not local(x))
    samples, steps, flops = counter(SAMPLES, local), counter(STEPS), counter(FLOPS, local)
    at_w: dict[str, float | None] = dict.fromkeys((TOKENS, SAMPLES, STEPS, FLOPS), 0.0)
    if warmup_applied:
        at_w = {TOKENS: run.counter_at_w(TOKENS, local), SAMPLES: run.counter_at_w(SAMPLES, local),
                STEPS: run.counter_at_w(STEPS), FLOPS: run.counter_at_w(FLOPS, local)}
    return _Counts(tokens_all, tokens, tokens_remote, samples, steps, flops,
                   billing.window_count(tokens, at_w[TOKENS]), billing.window_count(samples, at_w[SAMPLES]),
                   billing.window_count(steps, at_w[STEPS]), billing.window_count(flops, at_w[FLOPS]))


class _Energy(NamedTuple):
    """The run's energy figures (all None without a counter read on any of its GPUs)."""

    measured: bool
    energy_j: float | None
    window_j: float | None  # over the efficiency window
    idle_j: float | None  # None also while a GPU's idle power is not known
    window_idle_j: float | None
    coverage: float | None  # of its GPU-time, the part with a counter read


def _energy(run: Run, acc: Acc, warmup_applied: bool) -> _Energy:
    coverage = billing.energy_coverage(acc.measured_gpu_s, acc.expected_gpu_s)
    measured = acc.measured_gpu_s > 0
    if not measured:
        return _Energy(False, None, None, None, None, coverage)
    idle_w = {k: info.idle_w for k, info in run.gpu_info.items()}
    idle = billing.idle_total(acc.idle_j, acc.idle_unknown_s, idle_w)
    if not warmup_applied:
        return _Energy(True, acc.energy_j, acc.energy_j, idle, idle, coverage)
    window_idle = billing.idle_total(acc.win_idle_j, acc.win_idle_unknown_s, idle_w)
    return _Energy(True, acc.energy_j, acc.win_energy_j, idle, window_idle, coverage)


def _run_notes(run: Run, acc: Acc, local: Local, counts: _Counts, end: float, xids: Sequence[XidEvent]) -> list[str]:
    """What the run's summary says about its ranks, its GPUs' sharing, Xids and claims."""
    notes = []
    if counts.tokens_remote is not None:
        remote_ranks = sorted({x.rank for x in run.series.values() if x.name == TOKENS
                               and not local(x)}, key=rank_order)
        notes.append(f"tokens of rank(s) {', '.join(remote_ranks)} excluded from J/token and throughput: "
                     "their GPUs are not on this node (tokens_remote)")
    if run.sharers:
        others = sorted(run.sharers)
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        notes.append(f"shared its GPUs with run(s) {listed}: energy split "
                     f"({', '.join(sorted(run.splits))})")
    notes += xid_notes([*run.gpu_order, *run.gpus], run.s, end, xids)
    if ledger_split.SPLIT_MIG in run.splits:
        notes.append("MIG instances: charged their compute slices' share of the parent GPU's energy (instances "
                     "in use only; an instance whose profile NVML does not give weighs 1)")
    notes.extend(claim_notes(run, acc))
    return notes


def _energy_notes(run: Run, acc: Acc, energy: _Energy, missing: Sequence[str]) -> list[str]:
    """What the run's summary says about how far its energy, idle energy and CO2 are known."""
    notes = []
    if not run.gpus:
        notes.append("the run pushed no GPU UUID" + (f" (gpu_uuid={', '.join(sorted(run.non_gpu_labels))})"
                                                      if run.non_gpu_labels else "")
                     + ": no energy attributed")
    if missing:
        names = ", ".join(run.gpus[k] for k in missing)
        notes.append(f"GPUs not seen by this exporter (another node?): {names}")
    if energy.coverage is not None and energy.coverage < 0.999 and energy.measured:
        notes.append(f"energy counter available for {energy.coverage:.1%} of the run's GPU-time: energy is a "
                     "lower bound")
    if energy.measured and energy.idle_j is None:
        notes.append("idle power of the GPUs unknown (not learned yet, no --gpu.idle-power): no dynamic "
                     "energy")
    if energy.measured and acc.carbon_kwh > 0 and acc.carbon_missing_kwh > 0:
        notes.append("carbon intensity missing for part of the run: CO2 is a lower bound")
    return notes


def _run_part(run: Run, end: float, win: billing.Window, missing: Sequence[str]) -> dict[str, Any]:
    """The summary's first columns: the run, its times, its metadata and its GPUs."""
    keys = list(run.gpu_order)
    models: list[str] = []
    for k in keys:
        info = run.gpu_info.get(k)
        if info is not None and info.name not in models:
            models.append(info.name)
    return {
        "run_id": run.run_id,
        "status": run.status,
        "start_time": iso_utc(run.s),
        "end_time": iso_utc(end),
        "duration_s": win.duration_s,
        "warmup_s": win.warmup_s,
        "window_s": win.window_s,
        **{k: run.metadata.get(k) for k in METADATA_KEYS},
        "ranks": len(run.ranks),
        "gpu_count": len(keys) + len(missing),
        "gpu_uuids": " ".join([run.gpu_info[k].uuid for k in keys] + [run.gpus[k] for k in missing]),
        "gpu_models": "; ".join(models),
    }


def _efficiency_part(counts: _Counts, win: billing.Window, energy: _Energy) -> dict[str, Any]:
    """Tokens, samples, steps, FLOPs, and the throughput and J/token of the efficiency window."""
    j_per_token = billing.ratio(energy.window_j, counts.window_tokens)
    return {
        "tokens": counts.tokens_all,
        "tokens_local": counts.tokens,
        "tokens_remote": counts.tokens_remote or (0.0 if counts.tokens_all is not None else None),
        "token_coverage": billing.ratio(counts.tokens, counts.tokens_all),
        "samples": counts.samples,
        "steps": counts.steps,
        "flops": counts.flops,
        "window_tokens": counts.window_tokens,
        "tokens_per_s": billing.ratio(counts.window_tokens, win.window_s),
        "samples_per_s": billing.ratio(counts.window_samples, win.window_s),
        "j_per_token": j_per_token,
        "energy_per_10k_tokens_j": j_per_token * 10_000 if j_per_token is not None else None,
        "dynamic_j_per_token": billing.ratio(billing.dynamic_j(energy.window_j, energy.window_idle_j),
                                             counts.window_tokens),
    }


def _energy_part(run: Run, acc: Acc, energy: _Energy, win: billing.Window, window_flops: float | None,
                 peak: float | None, carbon: billing.Carbon) -> dict[str, Any]:
    """Energy, power, VRAM, MFU and CO2."""
    avg_power = billing.ratio(energy.energy_j, win.duration_s)
    memory = [run.gpu_info[k].memory_total for k in run.gpu_order if k in run.gpu_info]
    known_memory = [m for m in memory if m is not None]
    return {
        "energy_j": energy.energy_j,
        "energy_kwh": energy.energy_j / billing.J_PER_KWH if energy.energy_j is not None else None,
        "idle_energy_j": energy.idle_j,
        "dynamic_energy_j": billing.dynamic_j(energy.energy_j, energy.idle_j),
        "window_energy_j": energy.window_j,
        "avg_power_w": avg_power,
        # never below the average: a run whose snapshots all fell in dips still drew its average power
        "peak_power_w": billing.max_opt(acc.peak_power_w, avg_power),
        "vram_peak_bytes": acc.vram_peak,
        "vram_avg_bytes": billing.ratio(acc.vram_byte_s, acc.vram_s),
        "vram_total_bytes": float(max(known_memory)) if known_memory else None,
        "peak_flops_per_s": peak,
        "mfu": billing.mfu(window_flops, win.window_s, peak),
        "co2_g": carbon.co2_g,
        "carbon_intensity_g_per_kwh": carbon.intensity,
        "pue": carbon.pue,
    }


def _training_part(run: Run, counts: _Counts, energy: _Energy, win: billing.Window) -> dict[str, Any]:
    """Loss, learning rate and epoch as pushed, and the run's progress to its planned steps."""
    # Progress counts the trainer's global step, which includes the steps before a resume from a
    # checkpoint; `steps` (this process's steps) only where no global step was pushed.
    global_step = run.global_step()
    histograms = [s for s in run.series.values() if s.name == HISTOGRAM]
    step_s = billing.step_time_s(sum(s.last_v - s.baseline for s in histograms), sum(s.count for s in histograms))
    done = billing.progress(global_step if global_step is not None else counts.steps, run.total_steps,
                            step_s=step_s if step_s is not None else billing.ratio(win.duration_s, counts.steps),
                            j_per_step=billing.ratio(energy.window_j, counts.window_steps),
                            going=run.status in ("running", "finishing"))
    return {
        "best_loss": run.best_loss,
        "best_loss_step": run.best_loss_step,
        "last_loss": run.gauge(LOSS),
        "last_validation_loss": run.gauge(VALIDATION_LOSS),
        "last_learning_rate": run.gauge(LEARNING_RATE),
        "epoch": run.gauge(EPOCH),
        "total_steps": run.total_steps,
        "global_step": global_step,
        "progress": done.progress,
        "steps_remaining": done.steps_remaining,
        "eta_s": done.eta_s,
        "energy_to_finish_j": done.energy_to_finish_j,
        "mean_step_s": step_s,
    }


def _only_finite(out: dict[str, Any], notes: list[str], overflowed: set[str]) -> dict[str, Any]:
    """Non-finite figures never leave the ledger (two ranks' 1.5e308 tokens sum to inf; a gauge may be NaN):
    they read as unknown, and the note says which, so the CSV, the JSON API and /metrics stay valid."""
    unknown = billing.not_finite(out)
    for k in unknown:
        out[k] = None
    unknown += sorted(overflowed)
    if unknown:
        notes.append("figures not finite (overflow or NaN pushed), shown as unknown: " + ", ".join(unknown))
        out["ledger_notes"] = "; ".join(notes)
    return out


def details(run: Run) -> dict[str, Any]:
    """What ``/api/v1/run`` and the JSON summary add to the summary: GPUs, metadata and the timeline."""
    gpus = []
    for key in run.gpu_order:
        info = run.gpu_info[key]
        gpus.append({
            "uuid": info.uuid, "name": info.name, "energy_j": run.acc.per_gpu_j.get(key),
            "idle_power_w": info.idle_w, "idle_power_source": info.idle_source or None,
            "memory_total_bytes": info.memory_total,
        })
    timeline = [
        {"t": p[0], "power_w": list(p[1]), "energy_j": p[2], "tokens": p[3], "steps": p[4], "loss": p[5],
         "vram_used_bytes": p[6], "host_memory_available_bytes": p[7]}
        for p in run.timeline.points
    ]
    return {
        "gpus": gpus,
        "metadata": dict(run.metadata),
        "timeline_gpus": [run.gpu_info[k].uuid for k in run.gpu_order],
        "timeline": timeline,
    }


def fmt(value: Any) -> str:
    """A figure in a log line."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def claim_notes(run: Run, acc: Acc) -> list[str]:
    """What the GPUs' process lists said about the run's claims (docs/ledger.md, "What a claim needs")."""
    notes = []
    for key, seconds in sorted(acc.unconfirmed_s.items()):
        why = ("the run never sent its process.pid" if run.unconfirmed.get(key) == ledger_split.UNCONFIRMED_NO_PID
               else "NVML listed none of the run's processes there")
        notes.append(f"GPU {run.gpus.get(key, key)} claimed but not confirmed for {seconds:.1f}s after the claim "
                     f"grace ({why}): not charged for that time")
    if acc.unverified_s:
        names = ", ".join(run.gpus.get(k, k) for k in sorted(acc.unverified_s))
        notes.append(f"GPU(s) {names}: charged on the run's claim alone for part of the run (NVML's process list "
                     "or the host's process table was not available, or MIG): not verified by process")
    if run.silent:
        pids = ", ".join(str(p) for p in sorted(run.silent)[:8])
        notes.append(f"processes that are no run's (pid {pids}) shared its GPUs and kept their share "
                     "(the GPU's unattributed energy)")
    return notes


#: The summary keys of what no counter read has settled yet, and the figure each is a part of.
PROVISIONAL = (("energy_provisional_j", "energy_j"), ("window_energy_provisional_j", "window_energy_j"),
               ("co2_provisional_g", "co2_g"))


def with_provisional(live: Mapping[str, Any], settled: Mapping[str, Any] | None) -> dict[str, Any]:
    """``live`` with the parts of its energy, window energy and CO2 that no counter read has settled yet:
    what it counts beyond ``settled`` (the run's figures as of its settled time; None: all settled), at least
    0 (the settled figures can run past the live ones by the rounding of the counters' interpolation)."""
    out = dict(live)
    for key, of in PROVISIONAL:
        a = live.get(of)
        b = a if settled is None else settled.get(of)
        out[key] = max(0.0, a - b) if a is not None and b is not None else (0.0 if a is not None else None)
    return out

