"""The run ledger: per training run energy, tokens, J/token, power, VRAM and CO2, without Prometheus.

Fed from two sides: ``on_point`` receives every point the OTLP store accepted (request threads) and
``on_snapshot`` every sampler snapshot (sampler thread). A run lives from its first point until every
rank that pushed has sent ``training_run_finished 1`` (or until nothing was pushed for ``stale_after``,
in which case it ends at its last point). Then one row is appended to the CSV and a JSON summary is
written beside it (``<csv dir>/runs/<run id>.json``), both atomically (temp file, fsync, rename).
``collect()`` serves per-run series on /metrics; ``runs()`` / ``run(run_id)`` feed the JSON API
(``api.py``: ``/api/v1/runs``, ``/api/v1/run?id=``) that ``top``, ``report`` and ``runs --url`` read.

How the figures are made (docs/ledger.md has the full list of columns):

- Energy is the sum over the run's GPUs (the union of the ``gpu_uuid`` labels the run pushed, MIG
  instances mapped to their parent GPU) of the deltas of ``GPUState.energy_j`` between consecutive
  snapshots, times the run's share of the GPU (``ledger_split``: exclusive, even between runs naming the
  same GPU, MIG instances in use sharing their parent); what no run gets is the GPU's unattributed energy.
  The first and last segment are cut at the run's start and end by linear interpolation of the counter.
  Power is never integrated here.
- Only ranks whose GPUs are in the snapshots (local ranks) count in the efficiency figures; tokens of
  remote ranks are counted apart (``tokens_remote``).
- A run id that has pushed no training progress (no counter point) is tentative: hidden, never charged or
  written, evicted first when the ledger is full.
- The run's end may be known only after later snapshots were taken (a late finish point, a stale run that
  ends at its last point), so the ledger keeps a short history of snapshots and per-run checkpoints of its
  accumulators and replays the history from the last checkpoint before the end.
- Tokens, samples and FLOPs are summed over the run's series (each rank counts its own); steps are the
  maximum over ranks (every data-parallel rank takes the same optimizer steps).
- Efficiency figures (tokens/s, J/token, energy per 10k tokens) cover the window after the warm-up:
  energy and tokens at the warm-up boundary are interpolated (the counter between snapshots, each token
  series between its points). A run shorter than the warm-up uses the whole run and says so.

This module never calls NVML or reads hardware, never integrates power into energy, and never raises
into the sampler or request threads: a failing write is logged and counted, the run is kept and retried
with back-off on the sampler thread, and once more at shutdown.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import IO, Any, Protocol

from prometheus_client.core import Metric

from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.state import GPUState, Snapshot
from gpu_energy_exporter.core.textfmt import json_safe
from gpu_energy_exporter.ledger import split as ledger_split
from gpu_energy_exporter.ledger.split import Holding
from gpu_energy_exporter.reference.gpu_specs import lookup_peak_flops

log = logging.getLogger(__name__)

COLLECTOR = "ledger"

#: Identifies the JSON summary format.
SUMMARY_SCHEMA = "gpu-energy-exporter/run-summary/1"

# ----------------------------------------------------------------------------------------------------
# metric catalogue

_RUN = ("run_id",)

RUN_ACTIVE = metrics.define(
    "run", "active", "gauge",
    "1 while the training run is going, 0 once it finished (finished runs stay for a while, then go).",
    _RUN, collector=COLLECTOR)
RUN_INFO = metrics.define(
    "run", "info", "info",
    "Run metadata pushed by the training helper, its status (running, finishing, finished, stale, "
    "exporter_stopped), the GPUs it used (gpu_uuid, comma-joined) and how their energy was split with other "
    "runs (split: exclusive, even, sm_util, mig, comma-joined when it changed during the run).",
    (*_RUN, "status", "model", "backend", "optimizer", "precision", "gpu_uuid", "split"), collector=COLLECTOR)
RUN_DURATION = metrics.define(
    "run", "duration_seconds", "gauge", "Wall time of the run so far (from its first point).",
    _RUN, collector=COLLECTOR, unit="seconds")
# The run's energy, tokens, samples, steps, FLOPs and active seconds are counters that start at zero with
# the run (a resumed run id starts again from zero: a counter reset), so that rate() of two of them covers
# the same samples and their ratio is right from the run's first minute: J/token (energy / tokens) and
# throughput (tokens, samples, FLOPs / active seconds), see dashboards/rules/recording.yaml. See
# _counter_values for why they never decrease.
RUN_ENERGY = metrics.define(
    "run", "energy_joules_total", "counter",
    "Energy charged to the run since it started: its share of each of its GPUs on this node (split with "
    "other runs using the same GPU or MIG-partitioned GPU), from the GPU energy counters.",
    _RUN, collector=COLLECTOR, unit="joules")
RUN_DYNAMIC_ENERGY = metrics.define(
    "run", "dynamic_energy_joules", "gauge",
    "Run energy above the GPUs' idle baseline (energy - idle power x time); absent while the idle "
    "power is unknown.", _RUN, collector=COLLECTOR, unit="joules")
RUN_TOKENS = metrics.define(
    "run", "tokens_total", "counter",
    "Tokens processed by the run since it started, summed over the ranks that push to this exporter and whose "
    "GPUs are on this node (tokens of other ranks: gpuenergy_run_remote_tokens_total).",
    _RUN, collector=COLLECTOR)
RUN_REMOTE_TOKENS = metrics.define(
    "run", "remote_tokens_total", "counter",
    "Tokens pushed to this exporter by ranks whose GPUs are not on this node (not in J/token here).",
    _RUN, collector=COLLECTOR)
RUN_TOKEN_COVERAGE = metrics.define(
    "run", "token_coverage_ratio", "gauge",
    "Share of the tokens pushed to this exporter that come from ranks whose GPUs are on this node.",
    _RUN, collector=COLLECTOR)
RUN_STEPS = metrics.define(
    "run", "steps_total", "counter",
    "Optimizer steps the run took since it started: the maximum over the ranks that push to this exporter "
    "(every data-parallel rank takes every step).", _RUN, collector=COLLECTOR)
RUN_SAMPLES = metrics.define(
    "run", "samples_total", "counter",
    "Samples processed by the run since it started, summed over the ranks that push to this exporter and "
    "whose GPUs are on this node.",
    _RUN, collector=COLLECTOR)
RUN_FLOPS = metrics.define(
    "run", "flops_total", "counter",
    "Floating-point operations the trainer counted since the run started, summed over the ranks that push "
    "to this exporter and whose GPUs are on this node.", _RUN, collector=COLLECTOR)
RUN_ACTIVE_SECONDS = metrics.define(
    "run", "active_seconds_total", "counter",
    "Seconds the run has been active on this node: from its first point to the latest snapshot while it "
    "runs, its duration once it ended (then it stops growing). Divide a rate of the run's other counters by "
    "its rate for throughput that is right from the run's first minute.",
    _RUN, collector=COLLECTOR, unit="seconds")
RUN_TOKENS_PER_SECOND = metrics.define(
    "run", "tokens_per_second", "gauge",
    "Token throughput over the run's efficiency window (after the warm-up; the whole run while shorter).",
    _RUN, collector=COLLECTOR)
RUN_JOULES_PER_TOKEN = metrics.define(
    "run", "joules_per_token", "gauge",
    "GPU energy per token over the run's efficiency window (after the warm-up; the whole run while "
    "shorter).", _RUN, collector=COLLECTOR)
RUN_AVERAGE_POWER = metrics.define(
    "run", "average_power_watts", "gauge", "Run energy divided by its duration (the run's share of its GPUs).",
    _RUN, collector=COLLECTOR, unit="watts")
RUN_PEAK_POWER = metrics.define(
    "run", "peak_power_watts", "gauge",
    "Highest power charged to the run: its share of its GPUs' power at one snapshot or over one snapshot "
    "interval (never below the average power).", _RUN, collector=COLLECTOR, unit="watts")
RUN_MEMORY_PEAK = metrics.define(
    "run", "memory_peak_bytes", "gauge",
    "Highest GPU memory used on any one of the run's GPUs at one snapshot (all processes on that GPU).",
    _RUN, collector=COLLECTOR, unit="bytes")
RUN_PEAK_FLOPS = metrics.define(
    "run", "peak_flops_per_second", "gauge",
    "Dense peak FLOP/s of the run's GPUs on this node at the run's precision, a MIG instance counting its "
    "share of the parent GPU: the denominator of the run's MFU.", _RUN, collector=COLLECTOR)
RUN_MFU = metrics.define(
    "run", "mfu_ratio", "gauge",
    "Model FLOPs utilisation over the run's efficiency window: local FLOPs / window / peak FLOP/s.",
    _RUN, collector=COLLECTOR)
RUN_CO2 = metrics.define(
    "run", "co2_grams", "gauge",
    "CO2-equivalent of the run's GPU energy: kWh x PUE x grid intensity, integrated snapshot by snapshot.",
    _RUN, collector=COLLECTOR, unit="grams")
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

STATUSES = ("finished", "stale", "exporter_stopped")

# Back-off of failed ledger writes: 5 s, doubling, at most 5 minutes.
_RETRY_FIRST_S = 5.0
_RETRY_MAX_S = 300.0

#: The per-run counters on /metrics and the summary figure each one serves (``_counter_values``).
_COUNTER_COLUMNS = (
    (RUN_ENERGY, "energy_j"), (RUN_TOKENS, "tokens_local"), (RUN_REMOTE_TOKENS, "tokens_remote"),
    (RUN_STEPS, "steps"), (RUN_SAMPLES, "samples"), (RUN_FLOPS, "flops"), (RUN_ACTIVE_SECONDS, "duration_s"),
)

# ----------------------------------------------------------------------------------------------------
# the columns: one definition for the CSV, the JSON summary, the docs and the ``runs`` command


@dataclass(frozen=True)
class Column:
    name: str
    unit: str
    help: str


METADATA_KEYS: tuple[str, ...] = (
    "model", "backend", "optimizer", "batch_size", "grad_accum", "seq_len", "precision", "precision_raw",
    "seed", "world_size", "notes",
)

_METADATA_NOTES = {
    "precision": ": the compute precision, which the training helper normalises to `bf16`, `fp16`, `fp8`, "
                 "`tf32` or `fp32`",
    "precision_raw": ": the precision as the framework or the caller wrote it (`bf16-mixed`, `16-mixed`, "
                     "...), where it differs from `precision`",
}

COLUMNS: tuple[Column, ...] = (
    Column("run_id", "", "The `run_id` label of the run's points."),
    Column("status", "", "`finished` (every rank that pushed sent `training_run_finished 1`), `stale` (nothing "
           "pushed for `--runs.stale-after`; the run ends at its last point) or `exporter_stopped` (the "
           "exporter shut down during the run)."),
    Column("start_time", "ISO 8601, UTC", "Time of the run's first point (the trainer's clock)."),
    Column("end_time", "ISO 8601, UTC", "Time of the last rank's `training_run_finished 1` point, or of the "
           "last point of a stale run, or of the last snapshot before the exporter stopped."),
    Column("duration_s", "s", "`end_time - start_time`."),
    Column("warmup_s", "s", "Start of the run excluded from the efficiency figures: `--runs.warmup`, or 0 "
           "when the run was shorter than that (the efficiency figures then cover the whole run; "
           "`ledger_notes` says so)."),
    Column("window_s", "s", "The efficiency window: `duration_s - warmup_s`."),
    *(Column(k, "", f"`{k}` label of `training_run_info` (lowest rank that sent it){_METADATA_NOTES.get(k, '')}.")
      for k in METADATA_KEYS),
    Column("ranks", "count", "Distinct `rank` labels that pushed points for the run."),
    Column("gpu_count", "count", "GPUs attributed to the run: the union of its `gpu_uuid` labels, MIG "
           "instances mapped to their parent GPU (GPUs of other nodes included, see `ledger_notes`)."),
    Column("gpu_uuids", "", "Their UUIDs, space-separated."),
    Column("gpu_models", "", "Their distinct model names, `; `-separated."),
    Column("tokens", "tokens", "`training_tokens_total` summed over the run's series (every rank counts "
           "its own tokens), every rank that pushed to this exporter: `tokens_local + tokens_remote`."),
    Column("tokens_local", "tokens", "Tokens of the ranks whose GPUs are on this node (one of the series' "
           "`gpu_uuid` GPUs is in this exporter's snapshots; a series naming no GPU counts as local). The "
           "tokens J/token and throughput use."),
    Column("tokens_remote", "tokens", "Tokens of the other ranks (their GPUs are on another node, whose "
           "energy this exporter does not measure): counted apart, in no efficiency figure."),
    Column("token_coverage", "ratio", "`tokens_local / tokens`: below 1 when ranks of other nodes push "
           "to this exporter."),
    Column("samples", "samples", "`training_samples_total` summed over the local ranks' series."),
    Column("steps", "steps", "`training_steps_total`: the highest over ranks (data-parallel ranks take the "
           "same optimizer steps)."),
    Column("flops", "FLOP", "`training_flops_total` summed over the local ranks."),
    Column("window_tokens", "tokens", "Local tokens in the efficiency window: tokens at the end minus tokens "
           "at the warm-up boundary (each series interpolated between its points)."),
    Column("tokens_per_s", "tokens/s", "`window_tokens / window_s`."),
    Column("samples_per_s", "samples/s", "Samples in the efficiency window / `window_s`."),
    Column("j_per_token", "J/token", "`window_energy_j / window_tokens`."),
    Column("energy_per_10k_tokens_j", "J", "`10000 x j_per_token` (joules, not kJ)."),
    Column("dynamic_j_per_token", "J/token", "Dynamic (above idle) energy in the efficiency window / "
           "`window_tokens`."),
    Column("energy_j", "J", "Energy charged to the run from start to end: the deltas of each of its GPUs' "
           "energy counter (`gpuenergy_gpu_energy_joules_total`) between snapshots, cut at start and end by "
           "linear interpolation of the counter, times the run's share of the GPU (`energy_split`). Never "
           "integrated from power. GPUs of other nodes are not included."),
    Column("energy_kwh", "kWh", "`energy_j / 3.6e6`."),
    Column("idle_energy_j", "J", "Idle power of each GPU (`gpuenergy_gpu_idle_power_watts`, learned or "
           "`--gpu.idle-power`) x the time it was in the run x the run's share of it, summed; empty when no "
           "idle power was known."),
    Column("dynamic_energy_j", "J", "`energy_j - idle_energy_j` (negative if the idle baseline is set too "
           "high)."),
    Column("window_energy_j", "J", "Energy in the efficiency window (after the warm-up)."),
    Column("avg_power_w", "W", "`energy_j / duration_s`: average power charged to the run."),
    Column("peak_power_w", "W", "Highest power charged to the run: the larger of the sum over its GPUs of "
           "power at one snapshot (instant power where the GPU reports it, else NVML's averaged power) x the "
           "run's share, and the charged energy of one snapshot interval / its length. Never below "
           "`avg_power_w`."),
    Column("vram_peak_bytes", "bytes", "Highest GPU memory used on any one of the run's GPUs at one snapshot "
           "(NVML device memory: every process on that GPU, other runs' included). Per GPU, like the "
           "dashboards."),
    Column("vram_avg_bytes", "bytes", "Time-weighted average over the run of the memory used per GPU (the "
           "mean over the run's GPUs at each snapshot)."),
    Column("vram_total_bytes", "bytes", "Total memory of one of the run's GPUs (the largest)."),
    Column("co2_g", "g CO2e", "Sum over snapshot intervals of energy (kWh) x PUE x grid intensity (g/kWh) "
           "at that snapshot, so a changing intensity (`--carbon.intensity-file`) is honoured."),
    Column("carbon_intensity_g_per_kwh", "g CO2e/kWh", "Energy-weighted average grid intensity used."),
    Column("pue", "ratio", "Energy-weighted average PUE used (`--carbon.pue`)."),
    Column("peak_flops_per_s", "FLOP/s", "Dense peak FLOP/s of the run's GPUs on this node at the run's "
           "`precision` (bundled peak table), a MIG instance counting its share of the parent GPU (1 / the "
           "number of instances on it: MIG profiles are unknown); empty when the precision or a GPU model is "
           "not in the table."),
    Column("mfu", "ratio", "`flops` in the efficiency window / `window_s` / `peak_flops_per_s`."),
    Column("best_loss", "", "Lowest `training_loss` pushed by the lowest rank that sent loss."),
    Column("best_loss_step", "steps", "`steps` when that loss was pushed (same export)."),
    Column("last_loss", "", "Last `training_loss`."),
    Column("last_validation_loss", "", "Last `training_validation_loss`."),
    Column("last_learning_rate", "", "Last `training_learning_rate`."),
    Column("epoch", "epochs", "Last `training_epoch`."),
    Column("total_steps", "steps", "`training_run_total_steps`: the planned number of steps, if pushed."),
    Column("global_step", "steps", "`training_global_step`: the trainer's step count, steps before a resume from "
           "a checkpoint included (the highest over ranks of each rank's latest value); empty from a training "
           "helper that does not push it."),
    Column("progress", "ratio", "`global_step / total_steps` (`steps / total_steps` without a global step, "
           "which reads low after a resume), at most 1; empty without `total_steps`."),
    Column("steps_remaining", "steps", "`total_steps - global_step` (else `- steps`), at least 0."),
    Column("eta_s", "s", "Time to finish at the pace so far: `steps_remaining x mean_step_s` (else x "
           "`duration_s / steps`); empty once the run ended."),
    Column("energy_to_finish_j", "J", "Energy still to spend on this node if the remaining steps cost what "
           "the efficiency window's did: `steps_remaining x window_energy_j / ` the steps in the window."),
    Column("mean_step_s", "s", "Mean optimizer step time: `training_step_duration_seconds` sum / count over "
           "all ranks."),
    Column("energy_coverage", "ratio", "Fraction of the run's GPU-time on this node's GPUs for which an "
           "energy counter was available (below 1: a GPU was lost or had no counter; energy is a lower "
           "bound). GPUs of other nodes are not counted here: see `token_coverage`."),
    Column("energy_split", "", "How the run's GPUs' energy was shared, comma-joined when it changed: "
           "`exclusive` (the run alone on the GPU), `even` (split evenly with other runs on the GPU), "
           "`sm_util` (split by SM utilisation), `mig` (MIG instances: the parent GPU split over the "
           "instances in use)."),
    Column("summary_file", "", "The JSON summary, relative to the CSV's directory."),
    Column("ledger_notes", "", "What the ledger had to assume, `; `-separated."),
)
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)

#: Columns holding numbers (the others are text); the ``runs`` command parses these.
NUMERIC_COLUMNS: frozenset[str] = frozenset(
    c.name for c in COLUMNS if c.unit not in ("", "ISO 8601, UTC")
) | {"best_loss", "last_loss", "last_validation_loss", "last_learning_rate"}


def columns_markdown() -> str:
    """The CSV column table of docs/ledger.md (a test keeps the two identical)."""
    lines = ["| # | column | unit | how it is computed |", "|---|---|---|---|"]
    for i, c in enumerate(COLUMNS, 1):
        lines.append(f"| {i} | `{c.name}` | {c.unit or '-'} | {c.help} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------
# atomic files


def atomic_write(path: str, write: Callable[[IO[bytes]], object], mode: int | None = None) -> None:
    """Write a file so that readers see either the old content or the new, never a mix.

    ``write`` fills a temporary file in the same directory; it is flushed, fsynced and renamed over
    ``path``, then the directory is fsynced so the rename survives a power cut. If ``write`` raises,
    the temporary file is removed and ``path`` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            try:
                mode = os.stat(path).st_mode & 0o777
            except FileNotFoundError:
                mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def _csv_line(values: Iterable[str]) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(list(values))
    return buf.getvalue().encode("utf-8")


HEADER_LINE: bytes = _csv_line(COLUMN_NAMES)


def append_csv_row(path: str, row: Mapping[str, Any], clock: Callable[[], float] = time.time) -> None:
    """Append one row to the ledger CSV, writing the header for a new file.

    The whole file is rewritten to a temporary file and renamed (rows are few), so a crash never leaves a
    half-written row. A file whose header is not ours is renamed aside (``<path>.<time>.old``, with a
    warning), never appended to or overwritten.
    """
    try:
        with open(path, "rb") as f:
            existing = f.read()
    except FileNotFoundError:
        existing = b""
    if existing and existing.split(b"\n", 1)[0].rstrip(b"\r") + b"\n" != HEADER_LINE:
        stamp = datetime.fromtimestamp(clock(), timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        aside = f"{path}.{stamp}.old"
        n = 1
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.{stamp}-{n}.old"
        os.replace(path, aside)
        log.warning(
            "runs CSV %s has a different header (another tool's file or an older ledger version); moved "
            "it to %s and started a new file", path, aside)
        existing = b""
    if not existing:
        existing = HEADER_LINE
    elif not existing.endswith(b"\n"):
        existing += b"\n"
    line = _csv_line(format_csv_value(row.get(name)) for name in COLUMN_NAMES)
    atomic_write(path, lambda f: f.write(existing + line))


def format_csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return ""
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def summary_filename(run_id: str) -> str:
    """A file name for a run id (any characters may come over OTLP)."""
    name = _SAFE_NAME.sub("_", run_id).strip("._") or "run"
    return name[:120] + ".json"


def iso_utc(t: float | None) -> str | None:
    if t is None:
        return None
    text = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


# ----------------------------------------------------------------------------------------------------
# what one snapshot says about the GPUs


@dataclass(frozen=True, slots=True)
class _GPUFrame:
    uuid: str
    name: str
    energy_j: float | None  # None: GPU down or no counter
    power_w: float | None
    memory_used: int | None
    memory_total: int | None
    idle_w: float | None
    idle_source: str
    index: int = -1


@dataclass(frozen=True, slots=True)
class _Frame:
    t: float
    gpus: dict[str, _GPUFrame]  # by _uuid_key
    mig_parent: dict[str, str]  # MIG uuid key -> parent key
    intensity: float | None  # g/kWh
    pue: float | None
    host_available: float | None  # bytes


def _uuid_key(uuid: str) -> str:
    # torch reports UUIDs without the "GPU-" prefix; NVML with it. Compare without case or prefix.
    key = uuid.strip().lower()
    return key[4:] if key.startswith("gpu-") else key


def _gpu_frame(g: GPUState) -> _GPUFrame:
    r = g.reading
    power = None
    mem = total = None
    if r is not None:
        mem, total = r.memory_used_bytes, r.memory_total_bytes
        power = r.power_instant_w if r.power_instant_w is not None else r.power_average_w
    if not g.up:
        power = mem = None
    return _GPUFrame(
        uuid=g.identity.uuid, name=g.identity.name,
        energy_j=g.energy_j if g.up else None, power_w=power, memory_used=mem, memory_total=total,
        idle_w=g.idle_power_w, idle_source=g.idle_power_source, index=g.identity.index,
    )


_HOST_AVAILABLE = "gpuenergy_host_memory_available_bytes"


# ----------------------------------------------------------------------------------------------------
# per-run state


@dataclass(slots=True)
class _Acc:
    """What a run has accumulated up to time ``t``. Copied as checkpoints, so only plain values."""

    t: float
    energy_j: float = 0.0
    win_energy_j: float = 0.0
    idle_j: float = 0.0
    win_idle_j: float = 0.0
    # seconds per GPU during which its idle power was not known yet (filled in with the last known value)
    idle_unknown_s: dict[str, float] = field(default_factory=dict)
    win_idle_unknown_s: dict[str, float] = field(default_factory=dict)
    expected_gpu_s: float = 0.0
    measured_gpu_s: float = 0.0
    vram_byte_s: float = 0.0
    vram_s: float = 0.0
    vram_peak: float | None = None
    peak_power_w: float | None = None
    co2_g: float = 0.0
    carbon_kwh: float = 0.0  # energy that had an intensity, kWh
    carbon_weighted_intensity: float = 0.0  # sum of kWh x intensity
    carbon_weighted_pue: float = 0.0  # sum of kWh x pue
    carbon_missing_kwh: float = 0.0
    per_gpu_j: dict[str, float] = field(default_factory=dict)

    def copy(self) -> _Acc:
        return replace(self, idle_unknown_s=dict(self.idle_unknown_s),
                       win_idle_unknown_s=dict(self.win_idle_unknown_s), per_gpu_j=dict(self.per_gpu_j))


@dataclass(slots=True)
class _SeriesState:
    """One counter series (a metric + label set) of a run."""

    name: str
    rank: str
    baseline: float
    last_t: float
    last_v: float
    at_w: float | None = None  # value at the warm-up boundary, once a point at or after it arrived
    count: float = 0.0  # histograms: cumulative count (value is the cumulative sum)
    gpus: tuple[str, ...] = ()  # uuid keys of the series' gpu_uuid label (local or remote rank)


class Timeline:
    """A bounded series of points covering the whole run: when full, every other point is dropped and
    from then on only every other new point is kept, so resolution halves but coverage stays complete."""

    def __init__(self, max_points: int) -> None:
        if max_points < 4:
            raise ValueError("a timeline needs room for at least 4 points")
        self.max_points = max_points
        self.points: list[tuple[Any, ...]] = []
        self.stride = 1
        self._seen = 0

    def add(self, point: tuple[Any, ...], force: bool = False) -> None:
        self._seen += 1
        if not force and (self._seen - 1) % self.stride:
            return
        self.points.append(point)
        if len(self.points) >= self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def trim_after(self, t: float) -> None:
        self.points = [p for p in self.points if p[0] <= t]


_COUNTERS = {
    "training_tokens_total": "tokens",
    "training_samples_total": "samples",
    "training_steps_total": "steps",
    "training_flops_total": "flops",
}
_HISTOGRAM = "training_step_duration_seconds"
_POINT_LABELS = frozenset({"run_id", "rank", "gpu_uuid"})
_NOT_GPUS = frozenset({"", "none", "unknown"})


def _rank_order(rank: str) -> tuple[int, str]:
    try:
        return (int(rank), "")
    except ValueError:
        return (1 << 30, rank)


class _Run:
    def __init__(self, run_id: str, start: float, warmup: float, fresh: bool, timeline_points: int,
                 received: float) -> None:
        self.run_id = run_id
        self.s = start
        self.w = start + warmup
        self.e: float | None = None
        self.status = "running"
        self.fresh = fresh
        self.notes: list[str] = []
        if not fresh:
            self.notes.append("resumed after it had finished or gone stale: counters counted from the "
                              "first point of this resumption")
        self.series: dict[tuple[str, tuple[tuple[str, str], ...]], _SeriesState] = {}
        self.metadata: dict[str, str] = {}
        self.meta_rank: tuple[int, str] | None = None
        self.ranks: set[str] = set()
        self.finished_at: dict[str, float] = {}  # rank -> time of its first finished=1 point
        self.gpus: dict[str, str] = {}  # uuid key -> uuid as pushed
        self.non_gpu_labels: set[str] = set()
        self.gpu_labels_seen: set[str] = set()  # gpu_uuid label values already noted (bounded by the series)
        self.gauges: dict[str, tuple[tuple[int, str], float, float]] = {}  # name -> (rank order, t, value)
        self.best_loss: float | None = None
        self.best_loss_t = 0.0
        self.best_loss_step: float | None = None
        self.total_steps: float | None = None
        self.global_steps: dict[str, tuple[float, float]] = {}  # rank -> (t, training_global_step)
        self.last_point_t = start
        self.last_point_received = received
        self.acc = _Acc(t=start)
        self.checkpoints: deque[_Acc] = deque()
        self.alive_checkpoint = self.acc.copy()  # the last checkpoint not after the last point
        self.timeline = Timeline(timeline_points)
        self.gpu_order: list[str] = []  # frame keys in timeline order
        self.gpu_info: dict[str, _GPUFrame] = {}  # last frame of each GPU (names, idle power)
        self.resolved: set[str] = set()  # run GPU keys found in some snapshot
        self.summary: dict[str, Any] | None = None
        self.closed_at: float | None = None
        self.exposed: dict[str, float] = {}  # counter name -> highest value collect() has served
        # Created by a point that is no training progress (run_info, run_finished, ...): not shown, never
        # written, never charged energy, evicted first; becomes a run at its first counter point.
        self.tentative = True
        self.splits: set[str] = set()  # split rules used for the run's GPUs (ledger_split)
        self.sharers: set[str] = set()  # other runs it shared a GPU with
        self.written_json: str | None = None  # summary file already written (a retried write keeps it)
        self.write_failures = 0
        self.next_write_try = 0.0
        self.changes = 0  # bumped by every point applied to the run (a part of its live summary's stamp)
        self.live_memo: tuple[tuple[int, ...], dict[str, Any]] | None = None  # (stamp, live summary)

    # -- counters ------------------------------------------------------------------------------------

    def counter(self, name: str, local: Callable[[_SeriesState], bool] | None = None) -> float | None:
        """Summed over series (max for steps); ``local`` keeps only the series it accepts."""
        values = [s.last_v - s.baseline for s in self.series.values()
                  if s.name == name and (local is None or local(s))]
        if not values:
            return None
        return max(values) if name == "training_steps_total" else sum(values)

    def counter_at_w(self, name: str, local: Callable[[_SeriesState], bool] | None = None) -> float | None:
        values = [(s.at_w if s.at_w is not None else s.last_v) - s.baseline
                  for s in self.series.values() if s.name == name and (local is None or local(s))]
        if not values:
            return None
        return max(values) if name == "training_steps_total" else sum(values)

    def gauge(self, name: str) -> float | None:
        entry = self.gauges.get(name)
        return entry[2] if entry is not None else None

    def global_step(self) -> float | None:
        """The trainer's global step (steps before a resume included): the highest rank's latest value."""
        return max(v for _, v in self.global_steps.values()) if self.global_steps else None


class PointLike(Protocol):
    """What the OTLP store hands its listeners (``otlp.store.AcceptedPoint``)."""

    # read-only members, so frozen dataclasses (the store's AcceptedPoint) match
    @property
    def run_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def value(self) -> float: ...
    @property
    def time(self) -> float: ...


CarbonSource = Callable[[], "tuple[float, float]"]


class RunLedger:
    """Per-run energy accounting. Thread-safe: one lock; file writes happen outside it.

    ``csv_path``: ``--runs.csv`` (None keeps runs in memory only). ``warmup_s``: ``--runs.warmup``.
    ``stale_after_s``: ``--runs.stale-after``. ``carbon``: returns (grid intensity g/kWh, PUE), called
    once per snapshot on the sampler thread; None means no CO2 figures. ``clock``: wall time (staleness,
    how long finished runs are kept).
    """

    def __init__(
        self,
        csv_path: str | None,
        warmup_s: float = 30.0,
        stale_after_s: float = 300.0,
        carbon: CarbonSource | None = None,
        clock: Callable[[], float] = time.time,
        *,
        timeline_points: int = 2000,
        keep_finished_s: float = 900.0,
        max_finished_runs: int = 100,
        max_active_runs: int = 256,
        late_window_s: float = 120.0,
    ) -> None:
        if warmup_s < 0 or stale_after_s <= 0:
            raise ValueError("warmup_s must be >= 0 and stale_after_s > 0")
        self.csv_path = csv_path
        self.warmup_s = warmup_s
        self.stale_after_s = stale_after_s
        self._carbon = carbon
        self._clock = clock
        self._timeline_points = timeline_points
        self._keep_finished_s = keep_finished_s
        # Bounds memory under heavy run churn (each closed run keeps its timeline for report/top);
        # the CSV and JSON files keep every run.
        self._max_finished = max_finished_runs
        self._max_active = max_active_runs
        self._late_window_s = late_window_s
        # Snapshots are kept long enough to replay a stale run from its last point.
        self._history_s = stale_after_s + late_window_s
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()
        self._history: deque[_Frame] = deque()
        self._active: dict[str, _Run] = {}
        self._closed: list[_Run] = []  # finished, kept for keep_finished_s
        self._finished_counts: dict[str, float] = dict.fromkeys(STATUSES, 0.0)
        self._rejected = 0.0
        self._evicted = 0.0
        self._write_errors = 0.0
        # Closed runs whose files could not be written: retried with back-off, and at shutdown.
        self._pending: list[_Run] = []
        self._max_pending = max(1000, max_finished_runs)
        self._pending_dropped = 0
        # Who uses which GPU, by snapshot time (ledger_split.Holding), rebuilt when runs change.
        self._holders_gen = 0
        self._peak_rows: dict[str, dict[str, float]] = {}  # GPU model -> precision -> peak FLOP/s
        self._holders_cache: dict[float, dict[str, list[Holding]]] = {}
        self._holders_cache_gen = -1
        # Energy of each GPU charged to no run, settled when its interval leaves the snapshot history
        # (no late point can change who used the GPU then): uuid key -> (gpu index, uuid, joules).
        self._unattributed: dict[str, tuple[str, str, float]] = {}
        self._carbon_error_logged = False
        self._last_reject_log = -math.inf
        self._version = 0  # bumped whenever what collect() returns may have changed
        # Parts of each live summary's stamp (with the run's own points and _holders_gen): bumped by every
        # snapshot counted and every expiry of finished runs.
        self._snapshots = 0
        self._expirations = 0

    # ------------------------------------------------------------------------------------------------
    # points (request threads)

    def on_point(self, point: PointLike) -> None:
        """Store listener: ``TrainingStore.add_listener(ledger.on_point)``."""
        count = getattr(point, "count", None)
        self.record(point.run_id, point.name, point.labels, point.value, point.time,
                    count=float(count) if count is not None else None)

    #: points recorded per lock acquisition in ``on_points`` (a scrape of the ledger waits for one chunk)
    POINTS_CHUNK = 256

    def on_points(self, points: Sequence[PointLike]) -> None:
        """Store batch listener (``TrainingStore.add_batch_listener``): ``on_point`` for each of one
        request's points, taking the lock once per ``POINTS_CHUNK`` points."""
        for start in range(0, len(points), self.POINTS_CHUNK):
            with self._lock:
                for point in points[start:start + self.POINTS_CHUNK]:
                    count = getattr(point, "count", None)
                    self._record_locked(point.run_id, point.name, point.labels, point.value, point.time,
                                        float(count) if count is not None else None)

    def record(self, run_id: str, name: str, labels: Mapping[str, str], value: float, t: float, *,
               count: float | None = None) -> None:
        """One accepted point: ``value`` cumulative for counters (the histogram's sum, with ``count``),
        the value for gauges; ``t`` in Unix seconds."""
        with self._lock:
            self._record_locked(run_id, name, labels, value, t, count)

    def _record_locked(self, run_id: str, name: str, labels: Mapping[str, str], value: float, t: float,
                       count: float | None) -> None:
        if not run_id or not math.isfinite(value) or not math.isfinite(t):
            return
        progress = name in _COUNTERS or name == _HISTOGRAM
        self._version += 1
        run = self._active.get(run_id)
        if run is None:
            run = self._new_run(run_id, name, value, t)
            if run is None:
                return
        gpus_before = len(run.gpus)
        end_before = run.e
        self._apply(run, name, labels, value, t, count)
        if run.tentative:
            if not progress:
                return
            # The run's first training progress: it becomes a run. Its first point was stamped by the
            # trainer when it was collected, possibly before snapshots already received: count those
            # now that the run's GPUs are known, and give runs sharing its GPUs their new share.
            run.tentative = False
            self._holders_changed(run, run.s)
            self._replay(run, run.acc, run.s, math.inf, live=True)
            log.info("run %s started (first point at %s)", run_id, iso_utc(run.s))
            return
        if len(run.gpus) != gpus_before:
            self._holders_changed(run, run.s)
        elif run.e != end_before:
            self._holders_changed(run, min(x for x in (run.e, end_before) if x is not None))

    def _new_run(self, run_id: str, name: str, value: float, t: float) -> _Run | None:
        previous = [r for r in self._closed if r.run_id == run_id]
        if previous:
            # The SDK keeps re-exporting its last values until the trainer exits: only an explicit
            # "running again" (finished back to 0, after the end) resumes a closed run id.
            last = previous[-1]
            if not (name == "training_run_finished" and value == 0 and last.e is not None and t > last.e):
                return None
        if len(self._active) >= self._max_active:
            # Runs that never pushed training progress give way first (oldest push first): a flood of
            # run ids without progress (e.g. training_run_finished only) cannot keep a real run out.
            idle = [r for r in self._active.values() if r.tentative]
            if idle:
                victim = min(idle, key=lambda r: r.last_point_received)
                del self._active[victim.run_id]
                self._evicted += 1
        if len(self._active) >= self._max_active:
            self._rejected += 1
            now = self._clock()
            if now - self._last_reject_log > 60:
                self._last_reject_log = now
                log.warning("run ledger: already tracking %d active runs; ignoring new run %r (runs end on "
                            "training_run_finished or after --runs.stale-after)", self._max_active, run_id)
            return None
        run = _Run(run_id, t, self.warmup_s, not previous, self._timeline_points, self._clock())
        self._active[run_id] = run
        return run

    def _apply(self, run: _Run, name: str, labels: Mapping[str, str], value: float, t: float,
               count: float | None) -> None:
        rank = labels.get("rank", "")
        run.changes += 1
        run.ranks.add(rank)
        run.last_point_received = self._clock()
        if t > run.last_point_t:
            run.last_point_t = t
        gpu_label = labels.get("gpu_uuid", "")
        if gpu_label not in run.gpu_labels_seen:
            run.gpu_labels_seen.add(gpu_label)
            for part in gpu_label.split(","):
                self._note_gpu(run, part)
        order = _rank_order(rank)
        if name in _COUNTERS or name == _HISTOGRAM:
            self._apply_counter(run, name, labels, rank, value, t, count)
            if name == "training_steps_total" and run.best_loss is not None and t <= run.best_loss_t:
                run.best_loss_step = run.counter(name)
        elif name == "training_run_finished":
            self._apply_finished(run, rank, value, t)
        elif name == "training_run_info":
            if run.meta_rank is None or order <= run.meta_rank:
                run.meta_rank = order
                run.metadata = {k: v for k, v in labels.items() if k not in _POINT_LABELS}
        elif name == "training_run_gpu_info":
            pass  # its gpu_uuid label was noted above
        elif name == "training_run_total_steps":
            run.total_steps = value if run.total_steps is None else max(run.total_steps, value)
        elif name == "training_global_step":
            seen = run.global_steps.get(rank)
            if seen is None or t >= seen[0]:
                run.global_steps[rank] = (t, value)
        elif name in ("training_loss", "training_validation_loss", "training_learning_rate", "training_epoch"):
            prev = run.gauges.get(name)
            # One rank's view (the lowest that sends it): ranks' local losses are not comparable values.
            if prev is not None and (order > prev[0] or (order == prev[0] and t < prev[1])):
                return
            run.gauges[name] = (order, t, value)
            if name == "training_loss" and (run.best_loss is None or value < run.best_loss):
                run.best_loss, run.best_loss_t = value, t
                run.best_loss_step = run.counter("training_steps_total")

    def _note_gpu(self, run: _Run, uuid: str) -> None:
        text = uuid.strip()
        if text.lower() in _NOT_GPUS:
            run.non_gpu_labels.add(text or "(empty)")
            return
        key = _uuid_key(text)
        if key not in run.gpus:
            run.gpus[key] = text
            self._holders_gen += 1

    def _apply_counter(self, run: _Run, name: str, labels: Mapping[str, str], rank: str, value: float,
                       t: float, count: float | None) -> None:
        key = (name, tuple(sorted(labels.items())))
        s = run.series.get(key)
        if s is None:
            if run.fresh:
                # A fresh run's counters started at zero at its start: interpolate from there.
                s = _SeriesState(name, rank, baseline=0.0, last_t=min(run.s, t), last_v=0.0)
            else:
                s = _SeriesState(name, rank, baseline=value, last_t=t, last_v=value)
            s.gpus = tuple(_uuid_key(g) for g in labels.get("gpu_uuid", "").split(",")
                           if g.strip().lower() not in _NOT_GPUS)
            run.series[key] = s
        if t < s.last_t:
            return
        if s.at_w is None and t >= run.w:
            if s.last_t >= run.w or t == s.last_t:
                s.at_w = s.last_v
            else:
                s.at_w = s.last_v + (value - s.last_v) * (run.w - s.last_t) / (t - s.last_t)
        s.last_t, s.last_v = t, value
        if count is not None:
            s.count = count

    def _apply_finished(self, run: _Run, rank: str, value: float, t: float) -> None:
        if value >= 1:
            run.finished_at.setdefault(rank, t)
        else:
            run.finished_at.pop(rank, None)
            if run.status == "finishing":
                run.status, run.e = "running", None
            return
        if run.ranks and run.ranks <= set(run.finished_at):
            run.e = max(run.s, max(run.finished_at.values()))
            run.status = "finishing"

    # ------------------------------------------------------------------------------------------------
    # snapshots (sampler thread)

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Sampler listener: ``Sampler.add_listener(ledger.on_snapshot)``."""
        intensity = pue = None
        if self._carbon is not None:
            try:
                intensity, pue = self._carbon()
            except Exception as exc:  # noqa: BLE001 - a carbon source bug must not stop the ledger
                if not self._carbon_error_logged:
                    log.warning("run ledger: carbon intensity unavailable (%s); CO2 figures will be missing", exc)
                    self._carbon_error_logged = True
        gpus: dict[str, _GPUFrame] = {}
        mig: dict[str, str] = {}
        for g in snapshot.gpus:
            key = _uuid_key(g.identity.uuid)
            gpus[key] = _gpu_frame(g)
            for m in g.identity.mig_devices:
                mig[_uuid_key(m.uuid)] = key
        frame = _Frame(snapshot.timestamp, gpus, mig, intensity, pue, snapshot.value(_HOST_AVAILABLE))
        done: list[_Run] = []
        with self._lock:
            if self._history and frame.t <= self._history[-1].t:
                return  # a repeated or out-of-order snapshot adds nothing
            self._version += 1
            self._snapshots += 1
            prev = self._history[-1] if self._history else None
            self._history.append(frame)
            for key, gf in gpus.items():
                if key not in self._unattributed:
                    self._unattributed[key] = (str(gf.index), gf.uuid, 0.0)
            while len(self._history) > 1 and self._history[0].t < frame.t - self._history_s:
                self._settle(self._history[0], self._history[1])
                self._history.popleft()
            now = self._clock()
            for run in list(self._active.values()):
                if run.tentative:
                    if run.e is not None or now - run.last_point_received > self.stale_after_s:
                        del self._active[run.run_id]  # never a run: no row, no series
                    continue
                if prev is not None:
                    self._advance(run, prev, frame)
            for run in list(self._active.values()):
                if run.tentative:
                    continue
                if run.e is None and now - run.last_point_received > self.stale_after_s:
                    run.status = "stale"
                    run.e = run.last_point_t
                    log.warning("run %s: nothing pushed for %.0fs; closing it as stale at its last point (%s)",
                                run.run_id, self.stale_after_s, iso_utc(run.e))
                    self._holders_changed(run, run.e)
                if run.e is not None and (frame.t >= run.e or run.status == "stale"):
                    self._close(run, run.status if run.status == "stale" else "finished")
                    done.append(run)
            self._expire(now)
        for run in done:
            self._write(run)
        self._retry_writes(now)

    def _settle(self, f0: _Frame, f1: _Frame) -> None:
        """Add the unattributed part of each GPU's energy over (f0, f1] to its total."""
        span = f1.t - f0.t
        if span <= 0:
            return
        holders = self._holders(f1)
        for key, g1 in f1.gpus.items():
            g0 = f0.gpus.get(key)
            if g0 is None or g0.energy_j is None or g1.energy_j is None or g1.energy_j < g0.energy_j:
                continue
            free_s = ledger_split.unattributed(f0.t, f1.t, holders.get(key, []))
            if free_s > 0:
                index, uuid, joules = self._unattributed.get(key, (str(g1.index), g1.uuid, 0.0))
                self._unattributed[key] = (index, uuid, joules + (g1.energy_j - g0.energy_j) * free_s / span)

    def _holders(self, frame: _Frame) -> dict[str, list[Holding]]:
        """Physical GPU key -> the runs using it (with the MIG instance they name), as known now. Runs still
        tentative hold nothing; closed runs hold their GPUs from start to end."""
        if self._holders_cache_gen != self._holders_gen:
            self._holders_cache.clear()
            self._holders_cache_gen = self._holders_gen
        cached = self._holders_cache.get(frame.t)
        if cached is not None:
            return cached
        out: dict[str, list[Holding]] = {}
        for run in (*self._closed, *self._active.values()):
            if run.tentative:
                continue
            end = run.e if run.e is not None else math.inf
            for key in run.gpus:
                parent = frame.mig_parent.get(key, key)
                if parent not in frame.gpus:
                    continue
                out.setdefault(parent, []).append(
                    Holding(run.run_id, run.s, end, key if parent != key else ""))
        if len(self._holders_cache) > 4 * len(self._history) + 16:
            self._holders_cache.clear()
        self._holders_cache[frame.t] = out
        return out

    def _parents(self, run: _Run) -> set[str]:
        frame = self._history[-1] if self._history else None
        if frame is None:
            return set()
        return {frame.mig_parent.get(k, k) for k in run.gpus}

    def _holders_changed(self, run: _Run, t: float) -> None:
        """``run`` started, ended or named a GPU at ``t``: runs sharing its GPUs that already counted
        snapshots after ``t`` are recounted from their last checkpoint before it, with the new split."""
        self._holders_gen += 1
        mine = self._parents(run)
        if not mine:
            return
        for other in self._active.values():
            if other is run or other.tentative or other.acc.t <= t or not (mine & self._parents(other)):
                continue
            self._rewind(other, t)

    def _rewind(self, run: _Run, t: float) -> None:
        target = run.acc.t
        candidates = [c for c in (*run.checkpoints, run.alive_checkpoint) if c.t <= t]
        if not candidates:
            note = ("another run started or ended on its GPUs earlier than the ledger can recount: the split "
                    "of that moment is approximate")
            if note not in run.notes:
                run.notes.append(note)
            return
        base = max(candidates, key=lambda c: c.t)
        acc = base.copy()
        run.checkpoints = deque(c for c in run.checkpoints if c.t <= base.t)
        hi = run.e if run.e is not None else math.inf
        frames = list(self._history)
        for f0, f1 in zip(frames, frames[1:], strict=False):
            if f1.t <= acc.t or f0.t >= min(hi, target):
                continue
            self._integrate(run, acc, f0, f1, max(acc.t, run.s), min(hi, target), live=False)
            acc.t = max(acc.t, min(f1.t, hi, target))
            if run.e is None:
                ckpt = acc.copy()
                run.checkpoints.append(ckpt)
                if run.last_point_t >= f1.t:
                    run.alive_checkpoint = ckpt
        if run.alive_checkpoint.t > acc.t:
            run.alive_checkpoint = acc.copy()
        run.acc = acc

    def _advance(self, run: _Run, f0: _Frame, f1: _Frame) -> None:
        hi = run.e if run.e is not None else math.inf
        if run.acc.t >= hi:
            return
        self._integrate(run, run.acc, f0, f1, max(run.acc.t, run.s), hi, live=True)
        run.acc.t = max(run.acc.t, min(f1.t, hi))
        if run.e is not None:
            return
        # Points arrive after the snapshot that precedes them: the checkpoint of that snapshot is the last one
        # not after the run's last point (a run that stops pushing replays from there, not from its start).
        if run.checkpoints and run.alive_checkpoint.t < run.checkpoints[-1].t <= run.last_point_t:
            run.alive_checkpoint = run.checkpoints[-1]
        ckpt = run.acc.copy()
        run.checkpoints.append(ckpt)
        while run.checkpoints and run.checkpoints[0].t < f1.t - self._late_window_s:
            run.checkpoints.popleft()
        if run.last_point_t >= f1.t:
            run.alive_checkpoint = ckpt

    def _replay(self, run: _Run, acc: _Acc, lo: float, hi: float, live: bool) -> None:
        # Intervals ending at or before lo add nothing: start at the last snapshot not after lo (a live
        # summary replays from a recent checkpoint, so this reads the history's tail, not all of it).
        frames: list[_Frame] = []
        for frame in reversed(self._history):
            frames.append(frame)
            if frame.t <= lo:
                break
        frames.reverse()
        for f0, f1 in zip(frames, frames[1:], strict=False):
            if f0.t >= hi:
                break
            if f1.t <= lo:
                continue
            self._integrate(run, acc, f0, f1, lo, hi, live=live)
            acc.t = max(acc.t, min(f1.t, hi))

    def _integrate(self, run: _Run, acc: _Acc, f0: _Frame, f1: _Frame, lo: float, hi: float, *,
                   live: bool) -> None:
        """Add the part of the snapshot interval (f0, f1] that lies in [lo, hi] to ``acc``."""
        span = f1.t - f0.t
        a, b = max(f0.t, lo), min(f1.t, hi)
        overlap = b - a
        if span <= 0 or overlap <= 0:
            return
        wa = max(a, run.w)
        win = max(0.0, b - wa)
        keys = self._run_frame_keys(run, f1)
        holders = self._holders(f1)
        power_sum: float | None = None
        vram_sum: float | None = None
        vram_max: float | None = None
        vram_n = 0
        segment_j = 0.0
        measured_all = True
        for key in keys:
            g0, g1 = f0.gpus.get(key), f1.gpus.get(key)
            if g1 is None:
                continue  # not a GPU of this node: its energy is another exporter's
            acc.expected_gpu_s += overlap
            run.gpu_info[key] = g1
            if key not in run.gpu_order:
                run.gpu_order.append(key)
            hs = holders.get(key, [])
            share = ledger_split.charge(run.run_id, f0.t, f1.t, a, b, hs)
            win_share_s = ledger_split.charge(run.run_id, f0.t, f1.t, wa, b, hs).share_s if win > 0 else 0.0
            run.splits |= share.splits
            run.sharers |= share.sharers
            if g0 is not None and g0.energy_j is not None and g1.energy_j is not None \
                    and g1.energy_j >= g0.energy_j:
                delta = g1.energy_j - g0.energy_j
                joules = delta * share.share_s / span
                acc.energy_j += joules
                acc.win_energy_j += delta * win_share_s / span
                acc.per_gpu_j[key] = acc.per_gpu_j.get(key, 0.0) + joules
                acc.measured_gpu_s += overlap
                segment_j += joules
            else:
                measured_all = False
            if g1.idle_w is not None:
                acc.idle_j += g1.idle_w * share.share_s
                acc.win_idle_j += g1.idle_w * win_share_s
            else:
                acc.idle_unknown_s[key] = acc.idle_unknown_s.get(key, 0.0) + share.share_s
                acc.win_idle_unknown_s[key] = acc.win_idle_unknown_s.get(key, 0.0) + win_share_s
            if g1.power_w is not None:
                now_share = ledger_split.shares(h for h in hs if h.start <= f1.t <= h.end)
                power_sum = (power_sum or 0.0) + g1.power_w * now_share.get(run.run_id, (0.0, ""))[0]
            if g1.memory_used is not None:
                vram_sum = (vram_sum or 0.0) + g1.memory_used
                vram_max = _max_opt(vram_max, float(g1.memory_used))
                vram_n += 1
        if vram_sum is not None:
            acc.vram_byte_s += vram_sum / vram_n * overlap  # per GPU
            acc.vram_s += overlap
        # The interval's mean power (from the counter) is a power the run drew: with the instants below,
        # the peak is never below the run's average power.
        if measured_all and segment_j > 0:
            acc.peak_power_w = _max_opt(acc.peak_power_w, segment_j / overlap)
        # A snapshot's instantaneous values belong to the run only if it was taken inside the run.
        inside = lo < f1.t <= hi
        if inside:
            if power_sum is not None:
                acc.peak_power_w = _max_opt(acc.peak_power_w, power_sum)
            if vram_max is not None:
                acc.vram_peak = _max_opt(acc.vram_peak, vram_max)
        kwh = segment_j / 3.6e6
        if f1.intensity is not None:
            pue = f1.pue if f1.pue is not None else 1.0
            acc.co2_g += kwh * pue * f1.intensity
            acc.carbon_kwh += kwh
            acc.carbon_weighted_intensity += kwh * f1.intensity
            acc.carbon_weighted_pue += kwh * pue
        else:
            acc.carbon_missing_kwh += kwh
        if live and inside:
            power = tuple(f1.gpus[k].power_w if k in f1.gpus else None for k in run.gpu_order)
            run.timeline.add((
                f1.t, power, acc.energy_j, run.counter("training_tokens_total"),
                run.counter("training_steps_total"), run.gauge("training_loss"), vram_sum, f1.host_available,
            ))

    @staticmethod
    def _run_frame_keys(run: _Run, frame: _Frame) -> list[str]:
        """The frame's keys of the run's GPUs (MIG instances -> their parent, once each); GPUs the frame
        does not have keep their own key (they count as expected GPU-time without energy)."""
        keys: list[str] = []
        for key in run.gpus:
            k = frame.mig_parent.get(key, key)
            if k in frame.gpus:
                run.resolved.add(key)
            if k not in keys:
                keys.append(k)
        return keys

    # ------------------------------------------------------------------------------------------------
    # closing a run

    def _close(self, run: _Run, status: str) -> None:
        self._holders_gen += 1
        e = max(run.e if run.e is not None else run.acc.t, run.s)
        if run.acc.t > e or status == "stale":
            # The end lies before snapshots already counted: restart from the last checkpoint before it
            # and replay the snapshot history up to the end.
            candidates = [c for c in (*run.checkpoints, run.alive_checkpoint) if c.t <= e]
            base = max(candidates, key=lambda c: c.t) if candidates else _Acc(t=run.s)
            if self._history and self._history[0].t > base.t:
                run.notes.append("the run's end fell outside the snapshot history: energy near the end may "
                                 "be missing")
            acc = base.copy()
            self._replay(run, acc, max(acc.t, run.s), e, live=False)
            run.acc = acc
        elif run.acc.t < e and status != "exporter_stopped":
            run.notes.append("no snapshot after the run's end (exporter stopping): energy counted to the "
                             "last snapshot")
        run.acc.t = e
        run.e = e
        run.status = status
        run.timeline.trim_after(e)
        run.timeline.add((
            e, tuple(run.gpu_info[k].power_w if k in run.gpu_info else None for k in run.gpu_order),
            run.acc.energy_j, run.counter("training_tokens_total"), run.counter("training_steps_total"),
            run.gauge("training_loss"), None, None,
        ), force=True)
        run.checkpoints.clear()
        run.closed_at = self._clock()
        run.summary = self._summary(run)
        del self._active[run.run_id]
        self._closed.append(run)
        self._finished_counts[status] = self._finished_counts.get(status, 0.0) + 1
        s = run.summary
        log.info("run %s %s: %.0fs, %s tokens, %s J, %s J/token", run.run_id, status, s["duration_s"],
                 _fmt(s["tokens"]), _fmt(s["energy_j"]), _fmt(s["j_per_token"]))

    def _expire(self, now: float) -> None:
        kept = [r for r in self._closed if r.closed_at is not None and now - r.closed_at <= self._keep_finished_s]
        kept = kept[-self._max_finished:]
        if len(kept) != len(self._closed):
            self._closed = kept
            self._version += 1
            self._expirations += 1

    def version(self) -> int:
        """Changes whenever ``collect()`` may return something new (for ``exposition.CachedSource``)."""
        with self._lock:
            self._expire(self._clock())
            return self._version

    def close(self) -> None:
        """Close every active run and write it: a finishing run as ``finished`` (at its end), the others as
        ``exporter_stopped`` at the last snapshot counted; runs that never pushed training progress are
        dropped. Runs whose earlier writes failed are tried once more. Call once at shutdown, after the
        sampler stopped."""
        done: list[_Run] = []
        with self._lock:
            self._version += 1
            for run in list(self._active.values()):
                if run.tentative:
                    del self._active[run.run_id]
                    continue
                if run.status == "finishing":
                    self._close(run, "finished")
                else:
                    run.e = max(run.acc.t, run.s)
                    run.notes.append("the exporter stopped while the run was going")
                    self._close(run, "exporter_stopped")
                done.append(run)
        for run in done:
            self._write(run)
        self._retry_writes(math.inf)
        with self._lock:
            lost = [r.run_id for r in self._pending]
        if lost:
            log.error("run ledger: %d finished run(s) could not be written to %s and are lost at shutdown: %s",
                      len(lost), self.csv_path, ", ".join(lost))

    # ------------------------------------------------------------------------------------------------
    # figures

    def _live_summary(self, run: _Run) -> dict[str, Any]:
        """An active run's figures cut at its last point: counters are only known as of the last export,
        so counting energy up to the latest snapshot would charge the tokens of the last export interval
        for energy they have not been reported against yet (J/token too high by up to one interval).

        Kept until the run's stamp changes: a point of the run, a snapshot, or a change of who holds which
        GPU (which recounts runs sharing them); so a scrape recounts only the runs that changed. Returns a
        copy (callers may change it)."""
        stamp = (run.changes, self._snapshots, self._holders_gen, self._expirations)
        memo = run.live_memo
        if memo is None or memo[0] != stamp:
            memo = run.live_memo = (stamp, self._live_summary_now(run))
        return dict(memo[1])

    def _live_summary_now(self, run: _Run) -> dict[str, Any]:
        cut = run.last_point_t
        if run.e is None and run.s < cut < run.acc.t:
            candidates = [c for c in (*run.checkpoints, run.alive_checkpoint) if c.t <= cut]
            if candidates:
                acc = max(candidates, key=lambda c: c.t).copy()
                self._replay(run, acc, max(acc.t, run.s), cut, live=False)
                acc.t = cut
                return self._summary(run, acc)
        return self._summary(run)

    def _summary(self, run: _Run, acc: _Acc | None = None) -> dict[str, Any]:
        acc = run.acc if acc is None else acc
        local = self._local_check()
        end = acc.t if run.e is None else run.e
        duration = max(0.0, end - run.s)
        notes = list(run.notes)
        warmup_applied = duration > self.warmup_s
        if warmup_applied:
            warmup = self.warmup_s
            win_energy: float | None = acc.win_energy_j
            win_idle_j, win_unknown = acc.win_idle_j, acc.win_idle_unknown_s
            tokens_w = run.counter_at_w("training_tokens_total", local)
            samples_w = run.counter_at_w("training_samples_total", local)
        else:
            warmup = 0.0
            win_energy = acc.energy_j
            win_idle_j, win_unknown = acc.idle_j, acc.idle_unknown_s
            tokens_w = samples_w = 0.0
            if self.warmup_s > 0:
                notes.append(f"run shorter than the warm-up ({self.warmup_s:g}s): efficiency figures "
                             "cover the whole run")
        window = duration - warmup
        tokens_all = run.counter("training_tokens_total")
        tokens = run.counter("training_tokens_total", local)
        if tokens is None and tokens_all is not None:
            tokens = 0.0  # every rank is remote
        tokens_remote = run.counter("training_tokens_total", lambda x: not local(x))
        samples = run.counter("training_samples_total", local)
        window_tokens = tokens - (tokens_w or 0.0) if tokens is not None else None
        window_samples = samples - (samples_w or 0.0) if samples is not None else None
        if tokens_remote is not None:
            remote_ranks = sorted({x.rank for x in run.series.values() if x.name == "training_tokens_total"
                                   and not local(x)}, key=_rank_order)
            notes.append(f"tokens of rank(s) {', '.join(remote_ranks)} excluded from J/token and throughput: "
                         "their GPUs are not on this node (tokens_remote)")
        if run.sharers:
            others = sorted(run.sharers)
            listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            notes.append(f"shared its GPUs with run(s) {listed}: energy split "
                         f"({', '.join(sorted(run.splits))})")
        if ledger_split.SPLIT_MIG in run.splits:
            notes.append("MIG instances: charged their share of the parent GPU's energy, every instance in use "
                         "weighing 1 (MIG profiles unknown)")

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
        idle = self._idle_total(run, acc.idle_j, acc.idle_unknown_s) if measured else None
        win_idle = self._idle_total(run, win_idle_j, win_unknown) if measured else None
        if measured and idle is None:
            notes.append("idle power of the GPUs unknown (not learned yet, no --gpu.idle-power): no dynamic "
                         "energy")

        def ratio(num: float | None, den: float | None) -> float | None:
            if num is None or den is None or den <= 0:
                return None
            return num / den

        j_per_token = ratio(win_energy, window_tokens)
        steps = run.counter("training_steps_total")
        steps_w = run.counter_at_w("training_steps_total") if warmup_applied else 0.0
        window_steps = steps - (steps_w or 0.0) if steps is not None else None
        # Progress counts the trainer's global step, which includes the steps before a resume from a
        # checkpoint; `steps` (this process's steps) only where no global step was pushed.
        global_step = run.global_step()
        done = global_step if global_step is not None else steps
        total = run.total_steps
        progress = steps_remaining = None
        if done is not None and total is not None and total > 0:
            progress, steps_remaining = min(done / total, 1.0), max(total - done, 0.0)
        hist_sum = sum(s.last_v - s.baseline for s in run.series.values() if s.name == _HISTOGRAM)
        hist_count = sum(s.count for s in run.series.values() if s.name == _HISTOGRAM)
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
        elif measured and self._carbon is not None and acc.energy_j == 0:
            co2 = 0.0
        models = []
        for k in keys:
            info = run.gpu_info.get(k)
            if info is not None and info.name not in models:
                models.append(info.name)
        meta = run.metadata
        flops = run.counter("training_flops_total", local)
        flops_w = run.counter_at_w("training_flops_total", local) if warmup_applied else 0.0
        window_flops = flops - (flops_w or 0.0) if flops is not None else None
        peak_flops = self._peak_flops(run, meta.get("precision") or "")
        total_mem = [run.gpu_info[k].memory_total for k in keys if k in run.gpu_info]
        summary_file = None
        if self.csv_path is not None:
            summary_file = os.path.join("runs", summary_filename(run.run_id))
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
            "peak_power_w": acc.peak_power_w,
            "vram_peak_bytes": acc.vram_peak,
            "vram_avg_bytes": acc.vram_byte_s / acc.vram_s if acc.vram_s > 0 else None,
            "vram_total_bytes": float(max(m for m in total_mem if m is not None)) if any(
                m is not None for m in total_mem) else None,
            "peak_flops_per_s": peak_flops,
            "mfu": ratio(ratio(window_flops, window), peak_flops),
            "co2_g": co2,
            "carbon_intensity_g_per_kwh": intensity,
            "pue": pue,
            "best_loss": run.best_loss,
            "best_loss_step": run.best_loss_step,
            "last_loss": run.gauge("training_loss"),
            "last_validation_loss": run.gauge("training_validation_loss"),
            "last_learning_rate": run.gauge("training_learning_rate"),
            "epoch": run.gauge("training_epoch"),
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
        return out

    def _peak_flops(self, run: _Run, precision: str) -> float | None:
        """Peak FLOP/s of the run's local GPUs at ``precision``; a MIG instance counts 1 / (instances on its
        parent). None when any local GPU's model or the precision has no figure."""
        frame = self._history[-1] if self._history else None
        if frame is None or not precision:
            return None
        per_parent: dict[str, int] = {}
        for parent in frame.mig_parent.values():
            per_parent[parent] = per_parent.get(parent, 0) + 1
        share: dict[str, float] = {}
        for key in run.gpus:
            parent = frame.mig_parent.get(key, key)
            if parent not in frame.gpus:
                continue
            part = 1.0 / per_parent[parent] if parent != key else 1.0
            share[parent] = min(1.0, share.get(parent, 0.0) + part)
        if not share:
            return None
        total = 0.0
        for parent, part in share.items():
            name = frame.gpus[parent].name
            if name not in self._peak_rows:
                row = lookup_peak_flops(name)
                self._peak_rows[name] = dict(row.flops) if row is not None else {}
            value = self._peak_rows[name].get(precision)
            if not value:
                return None
            total += value * part
        return total

    def _local_check(self) -> Callable[[_SeriesState], bool]:
        """Whether a series comes from a rank whose GPUs this node measures: one of its ``gpu_uuid`` GPUs
        (or MIG instances) is in the latest snapshot. A series naming no GPU counts as local."""
        frame = self._history[-1] if self._history else None

        def local(series: _SeriesState) -> bool:
            if frame is None or not series.gpus:
                return True
            return any(k in frame.gpus or k in frame.mig_parent for k in series.gpus)

        return local

    def _idle_total(self, run: _Run, known_j: float, unknown_s: Mapping[str, float]) -> float | None:
        total = known_j
        for key, seconds in unknown_s.items():
            if seconds <= 0:
                continue
            info = run.gpu_info.get(key)
            # The baseline is learned while GPUs are idle, often only after the run started: the value
            # learned later applies to the whole run.
            if info is None or info.idle_w is None:
                return None
            total += info.idle_w * seconds
        return total

    def _details(self, run: _Run) -> dict[str, Any]:
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

    # ------------------------------------------------------------------------------------------------
    # files

    def check_writable(self) -> str | None:
        """None when the runs CSV and its summaries directory can be written, else one line saying what is
        wrong and what to do (the exporter logs it at start-up). Creates the directories, writes nothing
        else."""
        if self.csv_path is None:
            return None
        path = self.csv_path
        try:
            directory = os.path.dirname(os.path.abspath(path))
            runs_dir = os.path.join(directory, "runs")
            os.makedirs(runs_dir, exist_ok=True)
            for d in (directory, runs_dir):
                fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=d)
                os.close(fd)
                os.unlink(tmp)
            if os.path.isdir(path):
                raise IsADirectoryError(21, "is a directory", path)
        except OSError as exc:
            return (f"--runs.csv {path}: cannot write there ({getattr(exc, 'filename', None) or path}: "
                    f"{exc.strerror or exc}). Finished runs stay in memory and are retried until it works; "
                    "point --runs.csv at a writable file or fix the directory.")
        return None

    def _write(self, run: _Run) -> bool:
        """Write a closed run's JSON summary and CSV row. On failure the run is kept in ``_pending`` and
        retried with back-off (``_retry_writes``), at the latest at shutdown."""
        if self.csv_path is None or run.summary is None:
            return True
        with self._lock:
            summary = dict(run.summary)
            doc = {"schema": SUMMARY_SCHEMA, "start_unix": run.s, "end_unix": run.e,
                   "configured_warmup_s": self.warmup_s, **summary, **self._details(run)}
        with self._write_lock:
            try:
                directory = os.path.dirname(os.path.abspath(self.csv_path))
                runs_dir = os.path.join(directory, "runs")
                os.makedirs(runs_dir, exist_ok=True)
                name = run.written_json or summary_filename(run.run_id)
                path = os.path.join(runs_dir, name)
                if run.written_json is None and os.path.exists(path):
                    # The same run id again (resumed, or reused): keep the earlier summary.
                    stamp = datetime.fromtimestamp(run.s, timezone.utc).strftime("%Y%m%dT%H%M%SZ")
                    name = name[: -len(".json")] + f".{stamp}.json"
                    path = os.path.join(runs_dir, name)
                    summary["summary_file"] = doc["summary_file"] = os.path.join("runs", name)
                    with self._lock:
                        if run.summary is not None:
                            run.summary["summary_file"] = summary["summary_file"]
                payload = (json.dumps(json_safe(doc), indent=2, sort_keys=False) + "\n").encode("utf-8")
                atomic_write(path, lambda f: f.write(payload))
                run.written_json = name
                append_csv_row(self.csv_path, summary, self._clock)
            except OSError as exc:
                with self._lock:
                    self._write_errors += 1
                    self._version += 1
                    run.write_failures += 1
                    backoff = min(_RETRY_MAX_S, _RETRY_FIRST_S * 2 ** min(run.write_failures - 1, 16))
                    run.next_write_try = self._clock() + backoff
                    first = run not in self._pending
                    if first:
                        self._pending.append(run)
                        if len(self._pending) > self._max_pending:
                            dropped = self._pending.pop(0)
                            log.error("run ledger: more than %d runs waiting to be written; giving up on run %s",
                                      self._max_pending, dropped.run_id)
                if first:
                    log.error("run %s: cannot write the run ledger (%s: %s); the run is kept and retried until "
                              "it is written (at the latest at shutdown). Check that the directory of --runs.csv "
                              "exists and is writable.",
                              run.run_id, getattr(exc, "filename", None) or self.csv_path, exc.strerror or exc)
                return False
        with self._lock:
            if run in self._pending:
                self._pending.remove(run)
                self._version += 1
                log.warning("run %s: written to the run ledger after %d failed attempt(s)", run.run_id,
                            run.write_failures)
        return True

    def _retry_writes(self, now: float) -> None:
        """Retry the pending writes that are due (all of them with ``now = inf``), oldest first."""
        with self._lock:
            due = [r for r in self._pending if r.next_write_try <= now]
        for run in due:
            if not self._write(run):
                break  # the fault is still there: the others wait for their own turn

    # ------------------------------------------------------------------------------------------------
    # reading

    def runs(self) -> list[dict[str, Any]]:
        """Active and recently finished runs (summaries, oldest first); active ones are figured now."""
        with self._lock:
            out = [dict(r.summary) for r in self._closed if r.summary is not None]
            out.extend(self._live_summary(r) for r in self._active.values() if not r.tentative)
        out.sort(key=lambda s: s["start_time"] or "")
        return out

    def run(self, run_id: str) -> dict[str, Any] | None:
        """One run's summary plus its GPUs, metadata and timeline; the active instance if there is one."""
        with self._lock:
            run = self._active.get(run_id)
            if run is None or run.tentative:
                closed = [r for r in self._closed if r.run_id == run_id]
                if not closed:
                    return None
                run = closed[-1]
            summary = dict(run.summary) if run.summary is not None else self._live_summary(run)
            return {"schema": SUMMARY_SCHEMA, "start_unix": run.s, "end_unix": run.e,
                    "configured_warmup_s": self.warmup_s, **summary, **self._details(run)}

    @staticmethod
    def _counter_values(run: _Run, summary: Mapping[str, Any]) -> dict[str, float]:
        """The run's counters as served: the summary's figures, never below what was served before.

        The figures can go down: closing a run whose end became known late (a stale run, a late finish
        point) replays the snapshots only up to the end, and a rank's counter can restart. Prometheus
        would read a decrease as a reset and count the whole value again as an increase, a spike in every
        rate. So the served value holds the highest one served (for a run closed late it stays above the
        summary's ``energy_j`` by the energy counted after the end: at most ``stale_after`` of the GPUs'
        energy, seen in one rate window; likewise the active seconds, which hold the time until the run was
        found stale, a period with no tokens that throughput then averages in). Call with the ledger lock
        held."""
        out: dict[str, float] = {}
        for spec, key in _COUNTER_COLUMNS:
            value = summary.get(key)
            if value is None or not math.isfinite(value):
                continue
            served = max(float(value), run.exposed.get(spec.name, 0.0))
            run.exposed[spec.name] = served
            out[spec.name] = served
        return out

    def collect(self) -> list[Metric]:
        """Per-run series and the ledger's self-metrics (a live source of the /metrics collector)."""
        fams = {spec.name: spec.family() for spec in (
            RUN_ACTIVE, RUN_INFO, RUN_DURATION, RUN_ENERGY, RUN_DYNAMIC_ENERGY, RUN_TOKENS, RUN_STEPS,
            RUN_SAMPLES, RUN_FLOPS, RUN_ACTIVE_SECONDS, RUN_TOKENS_PER_SECOND, RUN_JOULES_PER_TOKEN,
            RUN_AVERAGE_POWER, RUN_PEAK_POWER, RUN_MEMORY_PEAK, RUN_CO2, RUN_REMOTE_TOKENS, RUN_TOKEN_COVERAGE,
            RUN_PEAK_FLOPS, RUN_MFU)}
        with self._lock:
            self._expire(self._clock())
            # A closed run and a resumed instance of it share the run id: show only the newest.
            by_id: dict[str, tuple[_Run, dict[str, Any]]] = {}
            for r in self._closed:
                if r.summary is not None:
                    by_id[r.run_id] = (r, r.summary)
            for r in self._active.values():
                if not r.tentative:
                    by_id[r.run_id] = (r, self._live_summary(r))
            counters = {run_id: self._counter_values(r, s) for run_id, (r, s) in by_id.items()}
            finished = dict(self._finished_counts)
            rejected, errors, evicted = self._rejected, self._write_errors, self._evicted
            pending = len(self._pending)
            unattributed = sorted(self._unattributed.values(), key=lambda x: (len(x[0]), x[0], x[1]))
        for run_id, (r, s) in by_id.items():
            lab = [run_id]
            metrics.add(fams[RUN_ACTIVE.name], lab, 1.0 if r.status in ("running", "finishing") else 0.0)
            metrics.add(fams[RUN_INFO.name], [run_id, r.status, *(s.get(k) or "" for k in (
                "model", "backend", "optimizer", "precision")), ",".join(s["gpu_uuids"].split()),
                s.get("energy_split") or ""], {})
            for name, total in counters[run_id].items():
                metrics.add(fams[name], lab, total)
            for spec, key in ((RUN_DURATION, "duration_s"), (RUN_DYNAMIC_ENERGY, "dynamic_energy_j"),
                              (RUN_TOKENS_PER_SECOND, "tokens_per_s"), (RUN_JOULES_PER_TOKEN, "j_per_token"),
                              (RUN_AVERAGE_POWER, "avg_power_w"), (RUN_PEAK_POWER, "peak_power_w"),
                              (RUN_MEMORY_PEAK, "vram_peak_bytes"), (RUN_CO2, "co2_g"),
                              (RUN_TOKEN_COVERAGE, "token_coverage"), (RUN_PEAK_FLOPS, "peak_flops_per_s"),
                              (RUN_MFU, "mfu")):
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


def _max_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


__all__ = [
    "COLUMNS", "COLUMN_NAMES", "Column", "RunLedger", "Timeline", "append_csv_row", "atomic_write",
    "columns_markdown", "summary_filename",
]
