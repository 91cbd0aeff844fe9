"""The runs API's documents: names shared by the ledger that writes them and the commands that read them.

One definition of what a run's figures are called wherever they leave the exporter: the per-run series on
/metrics (``gpuenergy_run_*``, which ``report --prometheus`` and the dashboards read back), the columns of
the runs CSV, the JSON summary and the ``/api/v1/runs`` documents (which ``runs``, ``top`` and ``report``
read), and the column table of docs/ledger.md (``columns_markdown``; a test keeps the two identical).

Plain data: the ledger (``gpu_energy_exporter.ledger``) computes the figures; the workstation commands
(``gpu_energy_exporter.client``) only read them, so both import these names from here and neither imports
the other. This module must never compute a figure, read a file or import anything above ``core``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.contract import ATTR_GPU_UUID, ATTR_RUN_ID, RUN_INFO_ATTRIBUTES

#: The collector name of every run-ledger series (docs/metrics.md groups them under it).
COLLECTOR = "ledger"

#: Identifies the JSON summary format.
SUMMARY_SCHEMA = "gpu-energy-exporter/run-summary/1"

#: How long ``/api/v1/runs`` (and so ``runs``, ``top``, ``report RUN_ID``) keeps a finished run, in seconds
#: (the ledger's default; the demo's banner says it); runs.csv and its JSON summaries keep them for good.
KEEP_FINISHED_S = 900.0

# ----------------------------------------------------------------------------------------------------
# the per-run series on /metrics

_RUN = (ATTR_RUN_ID,)

RUN_ACTIVE = metrics.define(
    "run", "active", "gauge",
    "1 while the training run is going, 0 once it finished (finished runs stay for a while, then go).",
    _RUN, collector=COLLECTOR)
RUN_INFO = metrics.define(
    "run", "info", "info",
    "Run metadata pushed by the training helper, its status (running, finishing, finished, stale, "
    "exporter_stopped), the GPUs it used (gpu_uuid, comma-joined) and how their energy was split with other "
    "runs (split: exclusive, even, sm_util, mig, grace, comma-joined when it changed during the run).",
    (*_RUN, "status", "model", "backend", "optimizer", "precision", ATTR_GPU_UUID, "split"),
    collector=COLLECTOR)
RUN_DURATION = metrics.define(
    "run", "duration_seconds", "gauge", "Wall time of the run so far (from its first point).",
    _RUN, collector=COLLECTOR, unit="seconds")
# The run's energy, tokens, samples, steps, FLOPs and active seconds are counters that start at zero with
# the run (a resumed run id starts again from zero: a counter reset), so that rate() of two of them covers
# the same samples and their ratio is right from the run's first minute: J/token (energy / tokens) and
# throughput (tokens, samples, FLOPs / active seconds), see dashboards/rules/recording.yaml. See
# ledger.specs.counter_values for why they never decrease.
RUN_ENERGY = metrics.define(
    "run", "energy_joules_total", "counter",
    "Energy charged to the run since it started, settled: its share of each of its GPUs on this node (split "
    "with other runs using the same GPU or MIG-partitioned GPU), from the GPU energy counters, up to the "
    "GPU's last energy-counter read (it lags by at most --collector.energy-interval; the part since is "
    "gpuenergy_run_energy_provisional_joules).", _RUN, collector=COLLECTOR, unit="joules")
RUN_PROVISIONAL_ENERGY = metrics.define(
    "run", "energy_provisional_joules", "gauge",
    "Energy charged to the run since its GPUs' last energy-counter read: the power readings' estimate, "
    "provisional until the next read settles it into gpuenergy_run_energy_joules_total (docs/measurement.md, "
    "settlement). Their sum is the run's energy now.", _RUN, collector=COLLECTOR, unit="joules")
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
    "Highest power charged to the run: its share of its GPUs' power at one snapshot (over one snapshot "
    "interval where the GPUs report no power), never below the average power.", _RUN, collector=COLLECTOR, unit="watts")
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
    "run", "co2_grams_total", "counter",
    "CO2-equivalent of the run's settled GPU energy (gpuenergy_run_energy_joules_total) since it started: each "
    "snapshot interval's energy (kWh) x PUE x the grid intensity in force then, so an increase() or rate() "
    "over any window is right across a change of intensity (the ledger's co2_g).", _RUN, collector=COLLECTOR,
    unit="grams")
# The efficiency window's counters: 0 during the run's warm-up (--runs.warmup), then the energy and the local
# tokens after it, the numerator and denominator of the ledger's J/token. Their increases over a range give
# the ledger's J/token for the part of the run in the range, warm-up excluded, where the whole-run counters
# above include the warm-up. A run shorter than the warm-up leaves them at 0 (its ledger figures then cover
# the whole run).
RUN_WINDOW_ENERGY = metrics.define(
    "run", "window_energy_joules_total", "counter",
    "Energy charged to the run after its warm-up (--runs.warmup), settled as gpuenergy_run_energy_joules_total: "
    "0 during the warm-up, then the ledger's window_energy_j. Over its token twin "
    "(gpuenergy_run_window_tokens_total): the ledger's J/token.",
    _RUN, collector=COLLECTOR, unit="joules")
RUN_WINDOW_TOKENS = metrics.define(
    "run", "window_tokens_total", "counter",
    "Tokens of the ranks on this node after the run's warm-up (--runs.warmup): 0 during the warm-up, then the "
    "ledger's window_tokens.", _RUN, collector=COLLECTOR)

# ----------------------------------------------------------------------------------------------------
# the columns: one definition for the CSV, the JSON summary, the docs and the ``runs`` command


@dataclass(frozen=True)
class Column:
    name: str
    unit: str
    help: str


#: The run's metadata columns: the training contract's ``training_run_info`` attributes, free-text ``notes``
#: last.
METADATA_KEYS: tuple[str, ...] = (*(k for k in RUN_INFO_ATTRIBUTES if k != "notes"), "notes")

_METADATA_NOTES = {
    "precision": ": the compute precision, which the training helper normalises to `bf16`, `fp16`, `fp8`, "
                 "`tf32` or `fp32`",
    "precision_raw": ": the precision as the framework or the caller wrote it (`bf16-mixed`, `16-mixed`, "
                     "...), where it differs from `precision`",
}

COLUMNS: tuple[Column, ...] = (
    Column(ATTR_RUN_ID, "", "The `run_id` label of the run's points."),
    Column("status", "", "`finished` (every rank that pushed sent `training_run_finished 1`), `stale` (nothing "
           "pushed for `--runs.stale-after`; the run ends at its last point) or `exporter_stopped` (the "
           "exporter shut down during the run and had no database; with one the run goes on after the "
           "restart)."),
    Column("start_time", "ISO 8601, UTC", "Time of the run's first point, on the ledger's steady clock "
           "(the trainer's timestamp placed against its arrival: docs/ledger.md, Time)."),
    Column("end_time", "ISO 8601, UTC", "Time of the last rank's `training_run_finished 1` point, or of the "
           "last point of a stale run, or of its last point when the exporter stopped without a database."),
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
    Column("peak_power_w", "W", "Highest power charged to the run: the sum over its GPUs of power at one "
           "snapshot (instant power where the GPU reports it, else NVML's averaged power) x the run's share; "
           "the charged energy of one snapshot interval / its length only where the GPUs report no power (the "
           "energy between counter reads is apportioned, so one short interval can carry a correction). Never "
           "below `avg_power_w`."),
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
           "`precision` (bundled peak table), a MIG instance counting its share of the parent GPU's SMs "
           "(NVML's instance attributes); empty when the precision or a GPU model is not in the table."),
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
           "`sm_util` (split by its processes' SM utilisation), `mig` (MIG instances: the parent GPU split "
           "over the instances in use by compute slices), `grace` (an unconfirmed claim within "
           "`--runs.claim-grace`, sharing only what no run's process used)."),
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

