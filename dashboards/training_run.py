"""The training-run dashboard: what a run's energy buys (J/token, throughput, MFU and PCU, the EfficientLLM
metrics, loss against energy, CO2, the energy to finish), and the per-run PromQL it shares.

Training series and labels are the training contract's (``gpu_energy_exporter.core.contract``:
``Instrument.prometheus``, ``ATTR_RUN_ID``, ``ATTR_GPU_UUID``), never retyped; recording-rule names are
those of ``dashboards/rules/recording.yaml``. Plain data: this module never imports grafana-foundation-sdk.
"""

from __future__ import annotations

from dashboards.spec import (
    BYTES,
    COUNT,
    DATASOURCE_VAR,
    GPU_LEGEND,
    GRAM,
    GRAMS_PER_HOUR,
    JOULE,
    RATIO,
    RUN_LEGEND,
    SCIENTIFIC,
    SECONDS,
    TOKENS_PER_SECOND,
    WATT,
    Dashboard,
    Panel,
    Query,
    Row,
    Variable,
    ledger_active_seconds,
    ledger_sum,
    sel,
)
from gpu_energy_exporter.core.contract import (
    ATTR_GPU_UUID,
    ATTR_RUN_ID,
    GLOBAL_STEP,
    LOSS,
    MODEL_PARAMETERS,
    RUN_GPU_INFO,
    RUN_INFO,
    RUN_INFO_ATTRIBUTES,
    RUN_TOTAL_STEPS,
    STEP_DURATION,
    STEPS,
    VALIDATION_LOSS,
)

RUN_VAR = Variable("run_id", "Run", f"label_values({RUN_INFO.prometheus}, {ATTR_RUN_ID})", include_all=False,
                   description=f"Training runs that pushed their metadata ({RUN_INFO.prometheus}).")
RUN = f'{ATTR_RUN_ID}=~"${RUN_VAR.name}"'
ONE_RUN = f'{ATTR_RUN_ID}="${RUN_VAR.name}"'  # inside a panel repeated per run

# Runs the ledgers covered completely at some point of the range (recording rule
# run_id:gpuenergy_run_energy_joules:ledger_complete): their ledger figures are used; other runs get the
# join-based fallback.
RUN_LEDGER_COMPLETE = f"max_over_time({sel('run_id:gpuenergy_run_energy_joules:ledger_complete', RUN)}[$__range])"
# The run's energy so far: the run ledgers' energy counters where they cover the run (exact, from the
# counters), else the recorded power integrated minute by minute over the dashboard range.
RUN_ENERGY_SO_FAR = (
    f"{ledger_sum(sel('gpuenergy_run_energy_joules_total', RUN))} and on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE}"
    f" or sum_over_time({sel('run_id:gpuenergy_gpu_energy_joules:rate5m', RUN)}[$__range:1m]) * 60"
)
_RUN_ENERGY_INCREASE = f"increase({sel('gpuenergy_run_energy_joules_total', RUN)}[$__range])"
_RUN_FLOPS_INCREASE = f"increase({sel('gpuenergy_run_flops_total', RUN)}[$__range])"
_RUN_ACTIVE_INCREASE = f"increase({sel('gpuenergy_run_active_seconds_total', RUN)}[$__range])"
_RUN_TOKENS_INCREASE = f"increase({sel('gpuenergy_run_tokens_total', RUN)}[$__range])"
# AEC, the run's average power over the part of the range it was active: the ledgers' energy increase over
# their active-seconds increase (both start with the run: 420 kJ over a 600 s run is 700 W however the run
# sits in the range), else the recorded power averaged over the range.
RUN_AVERAGE_POWER = (
    f"{ledger_sum(_RUN_ENERGY_INCREASE)} / on ({ATTR_RUN_ID}) {ledger_active_seconds(_RUN_ACTIVE_INCREASE)}"
    f" and on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE}"
    f" or avg_over_time({sel('run_id:gpuenergy_gpu_energy_joules:rate5m', RUN)}[$__range])"
)
# MFU over the range: the ledgers' FLOP increase over their active-seconds increase, against the peak (a
# range holds many whole logging intervals, so FLOPs counted in lumps average out), else the 5-minute MFU
# averaged over the range.
RUN_MFU_RANGE = (
    f"{ledger_sum(_RUN_FLOPS_INCREASE)} / on ({ATTR_RUN_ID}) {ledger_active_seconds(_RUN_ACTIVE_INCREASE)}"
    f" / on ({ATTR_RUN_ID}) max_over_time({sel('run_id:gpuenergy_gpu_peak_flops_per_second:sum', RUN)}[$__range])"
    f" or avg_over_time({sel('run_id:training_mfu:ratio_rate5m', RUN)}[$__range])"
)
_RUN_WINDOW_ENERGY_INCREASE = f"increase({sel('gpuenergy_run_window_energy_joules_total', RUN)}[$__range])"
_RUN_WINDOW_TOKENS_INCREASE = f"increase({sel('gpuenergy_run_window_tokens_total', RUN)}[$__range])"
# J/token over the dashboard range, on the ledger's terms: the ledgers' post-warm-up counters where they
# cover the run (energy and tokens after --runs.warmup, counted over the same samples: for a range holding
# the whole run, the ledger's own j_per_token), else the recorded power and token rate averaged over the
# range. The fallback is for runs the ledgers do not know or know only in part (a multi-node run whose ranks
# all push to one exporter: that ledger has every rank's tokens but one node's energy); it includes the
# warm-up, and a token rate younger than its 5-minute window reads low, so without a ledger the fallback
# overstates J/token for a run that started inside the range.
RUN_JOULES_PER_TOKEN_RANGE = (
    f"{ledger_sum(_RUN_WINDOW_ENERGY_INCREASE)}"
    f" / ({ledger_sum(_RUN_WINDOW_TOKENS_INCREASE)} > 0)"
    f" and on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE}"
    f" or (avg_over_time({sel('run_id:gpuenergy_gpu_energy_joules:rate5m', RUN)}[$__range])"
    f" / (avg_over_time({sel('run_id:training_tokens:rate5m', RUN)}[$__range]) > 0)"
    f" unless on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE})"
)
# CO2 so far: the ledgers' CO2 counters where they cover the run (each snapshot interval at the intensity in
# force then), else the recorded CO2 rate (from the GPUs' CO2 counters) summed minute by minute.
RUN_CO2_SO_FAR = (
    f"{ledger_sum(sel('gpuenergy_run_co2_grams_total', RUN))} and on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE}"
    f" or sum_over_time({sel('run_id:gpuenergy_gpu_co2_grams:rate5m', RUN)}[$__range:1m]) * 60"
)

# ---------------------------------------------------------------------------------------------------------
# Training run

TRAINING_DASHBOARD = Dashboard(
    name="training-run",
    uid="gpuenergy-training-run",
    title="GPU energy / Training run",
    description="What a training run's energy buys: J/token, throughput, MFU and PCU, the EfficientLLM "
                "metrics (AMU, PCU, AL, TT, ST, AEC), loss against energy, CO2 and the energy to finish.",
    variables=(DATASOURCE_VAR, RUN_VAR),
    rows=(
        Row("Energy", (
            Panel("stat", "Energy per token (range)",
                  "GPU joules per token over the part of the dashboard range in which the run was active, "
                  "on the run ledger's terms: the ledgers' post-warm-up energy increase / post-warm-up token "
                  "increase (gpuenergy_run_window_*_total; --runs.warmup excluded, as the ledger's "
                  "j_per_token: for a range holding the whole run it is the ledger's figure). No value for a "
                  "range inside the warm-up or for a run shorter than it. Fallback, for runs no ledger covers "
                  "completely (training data through another OTLP path, or a multi-node run whose ranks all "
                  "push to one exporter, whose ledger has one node's energy): mean run power / mean token "
                  "rate, warm-up included, which without a ledger overstates J/token when the run started "
                  "less than 5 minutes before the range ends or inside it.",
                  JOULE, (Query(RUN_JOULES_PER_TOKEN_RANGE, RUN_LEGEND),),
                  width=6, height=5),
            Panel("stat", "Energy so far",
                  "Energy of the run's GPUs since it started: the run ledgers' energy counters "
                  "(gpuenergy_run_energy_joules_total, summed over nodes; exact, from the GPUs' energy "
                  "counters). Fallback, for runs no ledger covers completely (training data through another "
                  "OTLP path, or a multi-node run whose ranks all push to one exporter, whose ledger sees "
                  "one node's GPUs): the recorded run power summed minute by minute over the dashboard range "
                  "(widen the range to cover the whole run; it lags the run's start by the 5-minute window).",
                  JOULE, (Query(RUN_ENERGY_SO_FAR, RUN_LEGEND),),
                  width=6, height=5),
            Panel("stat", "CO2 so far",
                  "CO2-equivalent of the run's GPU energy: energy (kWh) x PUE x grid intensity, each interval "
                  "at the intensity in force then: the run ledgers' CO2 counters (gpuenergy_run_co2_grams_total, "
                  "summed over nodes; warm-up included, like energy so far) for runs they cover completely, "
                  "else the recorded CO2 rate (the GPUs' CO2 counters) summed minute by minute. GPU energy "
                  "only: CPUs, memory, network and cooling beyond PUE are not included.",
                  GRAM, (Query(RUN_CO2_SO_FAR, RUN_LEGEND),),
                  width=6, height=5),
            Panel("stat", "Projected energy at finish",
                  f"Energy so far plus the steps still to take ({RUN_TOTAL_STEPS.prometheus} - "
                  f"{GLOBAL_STEP.prometheus}, the trainer's step count with the steps before a resume; "
                  f"{STEPS.prometheus} from a training helper that does not push it) at the energy per step "
                  "of the last 5 minutes. Only for runs that reported their total steps.",
                  JOULE, (Query(f"({RUN_ENERGY_SO_FAR})"
                                f" + on ({ATTR_RUN_ID}) "
                                f"{sel('run_id:training_energy_to_finish_joules:projected_rate5m', RUN)}",
                                RUN_LEGEND),),
                  width=6, height=5),
            Panel("timeseries", "Energy per token",
                  "GPU joules per token over the last 5 minutes (recording rule "
                  "run_id:training_energy_joules_per_token:ratio_rate5m): the run's GPUs' energy divided by "
                  "the tokens all its ranks processed, from the exporters' run ledgers' post-warm-up "
                  "counters (the ledger's window: nothing during --runs.warmup, then the ledger's J/token "
                  "for the part of the 5 minutes after it). Runs no ledger covers completely use the GPUs' "
                  "power / token rate, warm-up included, which without a ledger overstates J/token in the "
                  "run's first 5 minutes.",
                  JOULE, (Query(sel("run_id:training_energy_joules_per_token:ratio_rate5m", RUN), RUN_LEGEND),),
                  width=8),
            Panel("timeseries", "Tokens per second",
                  "Tokens processed per second by all ranks together (each token counted once) while the run "
                  "was active, over the last 5 minutes (recording rule run_id:training_tokens:rate5m): from "
                  "the run ledgers, right from the run's first minute; runs without a ledger (training data "
                  "through another OTLP path) read low in their first 5 minutes. For an inference run this is "
                  "the EfficientLLM inference throughput (IT).",
                  TOKENS_PER_SECOND, (Query(sel("run_id:training_tokens:rate5m", RUN), RUN_LEGEND),),
                  width=8),
            Panel("timeseries", "Energy per optimizer step",
                  "GPU joules per optimizer step over the last 5 minutes (recording rule "
                  "run_id:training_energy_joules_per_step:ratio_rate5m; from the run ledgers, like energy "
                  "per token).",
                  JOULE, (Query(sel("run_id:training_energy_joules_per_step:ratio_rate5m", RUN), RUN_LEGEND),),
                  width=8),
            Panel("timeseries", "Power of the run (AEC)",
                  "Power of all the run's GPUs together while the run was active, over the last 5 minutes "
                  "(recording rule run_id:gpuenergy_gpu_energy_joules:rate5m): the run ledgers' energy "
                  "counters over their active seconds, right from the run's first minute and with a shared "
                  "GPU split as the ledger splits it. Fallback, for runs no ledger covers completely: the "
                  "power of the GPUs the run reports, which in the run's first 5 minutes mixes in what the "
                  "GPUs drew before it started. The EfficientLLM average energy consumption (AEC) is its "
                  "mean; see below.",
                  WATT, (Query(sel("run_id:gpuenergy_gpu_energy_joules:rate5m", RUN), RUN_LEGEND),),
                  width=8),
            Panel("timeseries", "Power of each of the run's GPUs",
                  f"Each GPU the run reported in {RUN_GPU_INFO.prometheus}, with its node: the whole GPU's power "
                  "from its energy counter over 5 minutes (a GPU shared with another run shows its whole "
                  "power here). A GPU scraped under two targets is shown once (the target with the higher "
                  "reading).",
                  WATT, (Query(f"{sel('run_id_gpu_uuid:training_run_gpu_info:active', RUN)}"
                               f" * on ({ATTR_GPU_UUID}) group_left (instance, gpu) topk by ({ATTR_GPU_UUID}) (1,"
                               f" max by (instance, gpu, {ATTR_GPU_UUID})"
                               " (instance_gpu:gpuenergy_gpu_energy_joules:rate5m))",
                               f"{RUN_LEGEND} {GPU_LEGEND}"),),
                  width=8),
            Panel("timeseries", "Progress",
                  f"Optimizer steps taken against the total the run planned ({RUN_TOTAL_STEPS.prometheus}): the "
                  f"trainer's global step ({GLOBAL_STEP.prometheus}), which counts the steps before a resume from "
                  "a checkpoint too; from a training helper too old to push it, the steps of this process "
                  f"({STEPS.prometheus}), which restart at 0 on a resume.",
                  RATIO, (Query(f"(max by ({ATTR_RUN_ID}) ({sel(GLOBAL_STEP.prometheus, RUN)})"
                                f" or max by ({ATTR_RUN_ID}) ({sel(STEPS.prometheus, RUN)}))"
                                f" / max by ({ATTR_RUN_ID}) ({sel(RUN_TOTAL_STEPS.prometheus, RUN)} > 0)",
                                RUN_LEGEND),),
                  width=8, minimum=0, maximum=1),
        )),
        Row("EfficientLLM metrics (means over the part of the range the run was active)", (
            Panel("stat", "AMU: average VRAM per GPU",
                  "Average memory utilisation: VRAM in use per GPU of the run (the mean over its GPUs, not "
                  "the sum), averaged over time (framebuffer use, so other processes on the same GPU "
                  "count). The run ledger's VRAM figures (vram_avg_bytes, vram_peak_bytes, "
                  "gpuenergy_run_memory_peak_bytes) are sums over the run's GPUs: divide them by gpu_count "
                  "to compare.",
                  BYTES, (Query(f"avg_over_time({sel('run_id:gpuenergy_gpu_memory_used_bytes:avg', RUN)}"
                                "[$__range])", RUN_LEGEND),),
                  width=4, height=5),
            Panel("stat", "PCU: peak compute utilisation",
                  "Time-active utilisation (every GPU) and SM activity (Hopper and newer) of the run's GPUs, "
                  "averaged over GPUs and time. SM activity is the stricter figure: a GPU can be 100% "
                  "time-active with most SMs idle.",
                  RATIO, (Query(f"avg_over_time({sel('run_id:gpuenergy_gpu_utilization_ratio:avg', RUN)}"
                                "[$__range])", f"{RUN_LEGEND} time-active"),
                          Query(f"avg_over_time({sel('run_id:gpuenergy_gpu_sm_active_ratio:avg', RUN)}"
                                "[$__range])", f"{RUN_LEGEND} SM active")),
                  width=4, height=5, minimum=0, maximum=1),
            Panel("stat", "MFU",
                  "Model FLOPs utilisation over the range: the FLOPs the trainer counted per second of the "
                  "run's activity (the run ledgers' FLOP increase over their active-seconds increase) "
                  "against the dense peak of the run's GPUs at the run's precision (bf16, fp16, fp8 or tf32; "
                  "none for fp32). The peak is the run ledgers' where they cover the run, a MIG slice "
                  "counting its share of the parent GPU; a run on MIG slices without a ledger gets no MFU. A "
                  "range holds many logging intervals, so FLOPs counted in lumps (by a trainer that adds them "
                  "only at logging steps) average out. "
                  "Fallback, for runs without a ledger: the 5-minute MFU averaged over the range.",
                  RATIO, (Query(RUN_MFU_RANGE, RUN_LEGEND),),
                  width=4, height=5, minimum=0, maximum=1),
            Panel("stat", "AL: average step latency",
                  "Mean wall time of an optimizer step over every step every rank took in the range; no "
                  "data (not NaN) for a run that took no step in the range.",
                  SECONDS, (Query(f"sum by ({ATTR_RUN_ID}) (increase({sel(f'{STEP_DURATION.prometheus}_sum', RUN)}"
                                  "[$__range]))"
                                  f" / (sum by ({ATTR_RUN_ID}) "
                                  f"(increase({sel(f'{STEP_DURATION.prometheus}_count', RUN)}"
                                  "[$__range])) > 0)", RUN_LEGEND),),
                  width=3, height=5),
            Panel("stat", "TT: tokens / parameter / s",
                  "Token throughput per model parameter (pre-training figure of merit; needs the parameter "
                  f"count, {MODEL_PARAMETERS.prometheus}).",
                  SCIENTIFIC, (Query(f"avg_over_time({sel('run_id:training_tokens_per_parameter:rate5m', RUN)}"
                                     "[$__range])", RUN_LEGEND),),
                  width=3, height=5),
            Panel("stat", "ST: samples / parameter / s",
                  "Sample throughput per model parameter (fine-tuning figure of merit; needs the parameter "
                  f"count, {MODEL_PARAMETERS.prometheus}).",
                  SCIENTIFIC, (Query(f"avg_over_time({sel('run_id:training_samples_per_parameter:rate5m', RUN)}"
                                     "[$__range])", RUN_LEGEND),),
                  width=3, height=5),
            Panel("stat", "AEC: average power",
                  "Average energy consumption: mean power of all the run's GPUs together while the run was "
                  "active in the range, the run ledgers' energy increase over their active-seconds increase "
                  "(a 10-minute run that used 420 kJ reads 420 kJ / 600 s = 700 W, as the ledger's "
                  "avg_power_w). Fallback, for runs no ledger covers completely: the recorded run power "
                  "averaged over the range, which reads low for a run that started inside it (the 5-minute "
                  "window mixes in the GPUs' draw before the run).",
                  WATT, (Query(RUN_AVERAGE_POWER, RUN_LEGEND),),
                  width=3, height=5),
        )),
        Row("Utilisation over time", (
            Panel("timeseries", "MFU",
                  "Model FLOPs utilisation over the last 5 minutes (recording rule "
                  "run_id:training_mfu:ratio_rate5m), from the run ledgers' FLOP and active-time counters: "
                  "right from the run's first minute (runs without a ledger read low in their first 5 "
                  "minutes), and since the run started (run_id:training_mfu:ratio_since_start, ledger runs "
                  "only). The training helper counts FLOPs at every step; a FLOP counter that moves only at "
                  "logging steps (with a logging interval of minutes) makes the 5-minute line swing between "
                  "0 and several times the truth, while the since-start line holds every logging interval "
                  "but the last. No MFU for fp32 runs, nor for runs on MIG slices without a run ledger (the "
                  "ledger's peak counts the slice's share of the GPU; the peak table only the whole GPU).",
                  RATIO, (Query(sel("run_id:training_mfu:ratio_rate5m", RUN), f"{RUN_LEGEND} 5 min"),
                          Query(sel("run_id:training_mfu:ratio_since_start", RUN), f"{RUN_LEGEND} since start")),
                  width=8, minimum=0, maximum=1),
            Panel("timeseries", "PCU: time-active, SM and tensor activity",
                  "The run's GPUs averaged: NVML time-active utilisation, and GPM SM and tensor-core "
                  "activity (Hopper and newer).",
                  RATIO, (
                      Query(sel("run_id:gpuenergy_gpu_utilization_ratio:avg", RUN), f"{RUN_LEGEND} time-active"),
                      Query(sel("run_id:gpuenergy_gpu_sm_active_ratio:avg", RUN), f"{RUN_LEGEND} SM active"),
                      Query(sel("run_id:gpuenergy_gpu_tensor_active_ratio:avg", RUN), f"{RUN_LEGEND} tensor active"),
                  ),
                  width=8, minimum=0, maximum=1),
            Panel("timeseries", "VRAM per GPU (AMU)",
                  "VRAM in use per GPU of the run: the mean over its GPUs, not the sum (the run ledger's "
                  "VRAM figures are sums over the run's GPUs).",
                  BYTES, (Query(sel("run_id:gpuenergy_gpu_memory_used_bytes:avg", RUN), RUN_LEGEND),),
                  width=8),
            Panel("timeseries", "Step latency (AL)",
                  "Mean optimizer-step time over 5 minutes and the 95th percentile from the histogram "
                  "buckets (interpolated within a bucket); no data (not NaN) while no step ends.",
                  SECONDS, (
                      Query(sel("run_id:training_step_duration_seconds:mean5m", RUN), f"{RUN_LEGEND} mean"),
                      Query(f"histogram_quantile(0.95, sum by ({ATTR_RUN_ID}, le) "
                            f"(rate({sel(f'{STEP_DURATION.prometheus}_bucket', RUN)}[$__rate_interval]))"
                            f" and on ({ATTR_RUN_ID}) (sum by ({ATTR_RUN_ID}) "
                            f"(rate({sel(f'{STEP_DURATION.prometheus}_count', RUN)}[$__rate_interval])) > 0))",
                            f"{RUN_LEGEND} p95"),
                  )),
            Panel("timeseries", "Throughput per parameter (TT, ST)",
                  "Tokens and samples per second per model parameter.",
                  SCIENTIFIC, (
                      Query(sel("run_id:training_tokens_per_parameter:rate5m", RUN), f"{RUN_LEGEND} TT"),
                      Query(sel("run_id:training_samples_per_parameter:rate5m", RUN), f"{RUN_LEGEND} ST"),
                  )),
        )),
        Row("Loss and carbon", (
            Panel("timeseries", "Loss",
                  "Training and validation loss (mean over ranks).",
                  COUNT, (
                      Query(f"avg by ({ATTR_RUN_ID}) ({sel(LOSS.prometheus, RUN)})", f"{RUN_LEGEND} training"),
                      Query(f"avg by ({ATTR_RUN_ID}) ({sel(VALIDATION_LOSS.prometheus, RUN)})",
                            f"{RUN_LEGEND} validation"),
                  ),
                  width=8),
            Panel("xychart", "Loss against cumulative energy",
                  "Training loss (y) against the energy the run has used so far (x), from the exporter's "
                  "run ledger: how many joules each step down in loss costs. One panel per selected run.",
                  COUNT, (
                      Query(f"sum({sel('gpuenergy_run_energy_joules_total', ONE_RUN)})", "cumulative energy"),
                      Query(f"avg({sel(LOSS.prometheus, ONE_RUN)})", "loss"),
                  ),
                  width=8, repeat=RUN_VAR.name, overrides=(("cumulative energy", JOULE),),
                  xy=("cumulative energy", "loss")),
            Panel("timeseries", "CO2 rate",
                  "Grams of CO2-equivalent per hour caused by the run's GPUs: the run ledgers' energy (a shared "
                  "GPU split between its runs, a MIG slice's share) at each node's PUE and grid intensity, for "
                  "runs the ledgers cover; else the join on the run's GPUs, which charges a shared GPU to "
                  "every run on it.",
                  GRAMS_PER_HOUR, (Query(f"{sel('run_id:gpuenergy_gpu_co2_grams:rate5m', RUN)} * 3600",
                                         RUN_LEGEND),),
                  width=8),
            Panel("table", "Run metadata",
                  "What the run reported about itself: model, backend, optimizer, batch size, gradient "
                  "accumulation, sequence length, precision (normalised to bf16, fp16, fp8, tf32 or fp32; "
                  "precision_raw as the framework wrote it), seed, world size, notes.",
                  COUNT, (Query(f"max by ({', '.join((ATTR_RUN_ID, *RUN_INFO_ATTRIBUTES))}) "
                                f"({sel(RUN_INFO.prometheus, RUN)})"),),
                  width=24, height=6),
        )),
    ),
)
