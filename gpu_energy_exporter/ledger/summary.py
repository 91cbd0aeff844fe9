"""A run's figures: the summary document (the CSV row, the JSON summary, ``/api/v1/runs``) made from the
run's state and its accumulator, and the details of ``/api/v1/run``.

Pure: every function takes the run and plain values (the warm-up, which series are local, the peak FLOP/s)
and returns a new dict; nothing here locks, reads a snapshot, a clock or a file, or changes the run. The
column names and what each figure means are ``core.runs_schema.COLUMNS`` (docs/ledger.md).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpu_energy_exporter.core.health import XidEvent
from gpu_energy_exporter.core.runs_schema import METADATA_KEYS
from gpu_energy_exporter.ledger import split as ledger_split
from gpu_energy_exporter.ledger.accounting import Acc, idle_total, max_opt
from gpu_energy_exporter.ledger.files import RUNS_DIR, iso_utc, summary_filename
from gpu_energy_exporter.ledger.frames import Frame
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
    cut there too), else their latest values."""
    counter = run.counter if as_of is None else functools.partial(_counter_at, run, as_of)
    end = acc.t if run.e is None else run.e
    duration = max(0.0, end - run.s)
    notes = list(run.notes)
    # No warm-up (--runs.warmup=0s): the window is the whole run, whatever a rank's first point interpolates
    # to at the start (a rank joining late, a start backdated by another rank's process start).
    warmup_applied = warmup_s > 0 and duration > warmup_s
    if warmup_applied:
        warmup = warmup_s
        win_energy: float | None = acc.win_energy_j
        win_idle_j, win_unknown = acc.win_idle_j, acc.win_idle_unknown_s
        tokens_w = run.counter_at_w(TOKENS, local)
        samples_w = run.counter_at_w(SAMPLES, local)
    else:
        warmup = 0.0
        win_energy = acc.energy_j
        win_idle_j, win_unknown = acc.idle_j, acc.idle_unknown_s
        tokens_w = samples_w = 0.0
        if warmup_s > 0:
            notes.append(f"run shorter than the warm-up ({warmup_s:g}s): efficiency figures "
                         "cover the whole run")
    window = duration - warmup
    tokens_all = counter(TOKENS)
    tokens = counter(TOKENS, local)
    if tokens is None and tokens_all is not None:
        tokens = 0.0  # every rank is remote
    tokens_remote = counter(TOKENS, lambda x: not local(x))
    samples = counter(SAMPLES, local)
    window_tokens = tokens - (tokens_w or 0.0) if tokens is not None else None
    window_samples = samples - (samples_w or 0.0) if samples is not None else None
    if tokens_remote is not None:
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
    keys = list(run.gpu_order)
    missing = [k for k in run.gpus if k not in run.resolved]
    measured = acc.measured_gpu_s > 0
    if not run.gpus:
        notes.append("the run pushed no GPU UUID" + (f" (gpu_uuid={', '.join(sorted(run.non_gpu_labels))})"
                                                      if run.non_gpu_labels else "")
                     + ": no energy attributed")
    if missing:
        names = ", ".join(run.gpus[k] for k in missing)
        notes.append(f"GPUs not seen by this exporter (another node?): {names}")
    coverage = acc.measured_gpu_s / acc.expected_gpu_s if acc.expected_gpu_s > 0 else None
    if coverage is not None and coverage < 0.999 and measured:
        notes.append(f"energy counter available for {coverage:.1%} of the run's GPU-time: energy is a "
                     "lower bound")
    energy = acc.energy_j if measured else None
    if not measured:
        win_energy = None
    idle_w = {k: info.idle_w for k, info in run.gpu_info.items()}
    idle = idle_total(acc.idle_j, acc.idle_unknown_s, idle_w) if measured else None
    win_idle = idle_total(win_idle_j, win_unknown, idle_w) if measured else None
    if measured and idle is None:
        notes.append("idle power of the GPUs unknown (not learned yet, no --gpu.idle-power): no dynamic "
                     "energy")

    def ratio(num: float | None, den: float | None) -> float | None:
        if num is None or den is None or den <= 0:
            return None
        return num / den

    j_per_token = ratio(win_energy, window_tokens)
    steps = counter(STEPS)
    steps_w = run.counter_at_w(STEPS) if warmup_applied else 0.0
    window_steps = steps - (steps_w or 0.0) if steps is not None else None
    # Progress counts the trainer's global step, which includes the steps before a resume from a
    # checkpoint; `steps` (this process's steps) only where no global step was pushed.
    global_step = run.global_step()
    done = global_step if global_step is not None else steps
    total = run.total_steps
    progress = steps_remaining = None
    if done is not None and total is not None and total > 0:
        progress, steps_remaining = min(done / total, 1.0), max(total - done, 0.0)
    hist_sum = sum(s.last_v - s.baseline for s in run.series.values() if s.name == HISTOGRAM)
    hist_count = sum(s.count for s in run.series.values() if s.name == HISTOGRAM)
    mean_step_s = hist_sum / hist_count if hist_count > 0 else None
    pace = mean_step_s if mean_step_s is not None else ratio(duration, steps)
    eta = (steps_remaining * pace if steps_remaining is not None and pace is not None
           and run.status in ("running", "finishing") else None)
    j_per_step = ratio(win_energy, window_steps)
    dyn_window = win_energy - win_idle if win_energy is not None and win_idle is not None else None
    co2 = intensity = pue = None
    if measured and acc.carbon_kwh > 0:
        co2 = acc.co2_g
        intensity = acc.carbon_weighted_intensity / acc.carbon_kwh
        pue = acc.carbon_weighted_pue / acc.carbon_kwh
        if acc.carbon_missing_kwh > 0:
            notes.append("carbon intensity missing for part of the run: CO2 is a lower bound")
    elif measured and carbon_configured and acc.energy_j == 0:
        co2 = 0.0
    models = []
    for k in keys:
        info = run.gpu_info.get(k)
        if info is not None and info.name not in models:
            models.append(info.name)
    meta = run.metadata
    flops = counter(FLOPS, local)
    flops_w = run.counter_at_w(FLOPS, local) if warmup_applied else 0.0
    window_flops = flops - (flops_w or 0.0) if flops is not None else None
    total_mem = [run.gpu_info[k].memory_total for k in keys if k in run.gpu_info]
    out: dict[str, Any] = {
        "run_id": run.run_id,
        "status": run.status,
        "start_time": iso_utc(run.s),
        "end_time": iso_utc(end),
        "duration_s": duration,
        "warmup_s": warmup,
        "window_s": window,
        **{k: meta.get(k) for k in METADATA_KEYS},
        "ranks": len(run.ranks),
        "gpu_count": len(keys) + len(missing),
        "gpu_uuids": " ".join([run.gpu_info[k].uuid for k in keys] + [run.gpus[k] for k in missing]),
        "gpu_models": "; ".join(models),
        "tokens": tokens_all,
        "tokens_local": tokens,
        "tokens_remote": tokens_remote or (0.0 if tokens_all is not None else None),
        "token_coverage": ratio(tokens, tokens_all),
        "samples": samples,
        "steps": steps,
        "flops": flops,
        "window_tokens": window_tokens,
        "tokens_per_s": ratio(window_tokens, window),
        "samples_per_s": ratio(window_samples, window),
        "j_per_token": j_per_token,
        "energy_per_10k_tokens_j": j_per_token * 10_000 if j_per_token is not None else None,
        "dynamic_j_per_token": ratio(dyn_window, window_tokens),
        "energy_j": energy,
        "energy_kwh": energy / 3.6e6 if energy is not None else None,
        "idle_energy_j": idle,
        "dynamic_energy_j": energy - idle if energy is not None and idle is not None else None,
        "window_energy_j": win_energy,
        "avg_power_w": ratio(energy, duration),
        # never below the average: a run whose snapshots all fell in dips still drew its average power
        "peak_power_w": max_opt(acc.peak_power_w, ratio(energy, duration)),
        "vram_peak_bytes": acc.vram_peak,
        "vram_avg_bytes": acc.vram_byte_s / acc.vram_s if acc.vram_s > 0 else None,
        "vram_total_bytes": float(max(m for m in total_mem if m is not None)) if any(
            m is not None for m in total_mem) else None,
        "peak_flops_per_s": peak,
        "mfu": ratio(ratio(window_flops, window), peak),
        "co2_g": co2,
        "carbon_intensity_g_per_kwh": intensity,
        "pue": pue,
        "best_loss": run.best_loss,
        "best_loss_step": run.best_loss_step,
        "last_loss": run.gauge(LOSS),
        "last_validation_loss": run.gauge(VALIDATION_LOSS),
        "last_learning_rate": run.gauge(LEARNING_RATE),
        "epoch": run.gauge(EPOCH),
        "total_steps": run.total_steps,
        "global_step": global_step,
        "progress": progress,
        "steps_remaining": steps_remaining,
        "eta_s": eta,
        "energy_to_finish_j": (steps_remaining * j_per_step
                               if steps_remaining is not None and j_per_step is not None else None),
        "mean_step_s": mean_step_s,
        "energy_coverage": coverage,
        "energy_split": ",".join(sorted(run.splits)),
        "summary_file": summary_file,
        "ledger_notes": "; ".join(notes),
    }
    # Non-finite figures never leave the ledger (two ranks' 1.5e308 tokens sum to inf; a gauge may be NaN):
    # they read as unknown, and the note says which, so the CSV, the JSON API and /metrics stay valid.
    overflowed = [k for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)]
    for k in overflowed:
        out[k] = None
    overflowed += sorted(run.overflowed)
    if overflowed:
        notes.append("figures not finite (overflow or NaN pushed), shown as unknown: " + ", ".join(overflowed))
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

