"""Build the bundled Grafana dashboards and the generated parts of docs/dashboards.md.

``python -m dashboards.build`` writes ``dashboards/<name>.json`` (Grafana 11.6 schema, built with
grafana-foundation-sdk) and replaces the generated sections of ``docs/dashboards.md`` (panel reference,
rule reference). ``--check`` writes nothing and exits 1 when a file is out of date. The output is
deterministic: sorted keys, fixed panel ids, no timestamps, no version counters.

Every panel is declared once below as a ``Panel`` spec: its PromQL, legend, unit and description feed both
the JSON and the docs. Expressions use the recording rules of ``dashboards/rules/recording.yaml`` wherever
a join repeats; each one must have a promtool test in ``dashboards/tests/`` (tests/test_dashboards.py
checks that). This module never talks to Grafana or Prometheus.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    dashboard,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
    xychart,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as prometheus_models
from grafana_foundation_sdk.models import xychart as xychart_models

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

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "dashboards"
RULES_DIR = DASHBOARD_DIR / "rules"
DOCS = ROOT / "docs" / "dashboards.md"

TAG = "gpu-energy-exporter"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Grafana unit ids. The SI ones scale themselves (W -> kW, J -> MJ, g -> kg).
WATT = "watt"
KWH = "kwatth"
JOULE = "joule"
GRAM = "massg"
RATIO = "percentunit"
BYTES = "bytes"
CELSIUS = "celsius"
HERTZ = "hertz"
SECONDS = "s"
COUNT = "none"
SCIENTIFIC = "sci"
ON_OFF = "bool_on_off"
TOKENS_PER_SECOND = "suffix: tokens/s"
GRAMS_PER_HOUR = "suffix: g/h"

PanelKind = Literal["timeseries", "stat", "bargauge", "table", "statetimeline", "xychart"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """One panel: what the docs list and the JSON holds."""

    kind: PanelKind
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    width: int = 12
    height: int = 8
    time_from: str | None = None  # a relative time override, e.g. "now/d" (today so far)
    minimum: float | None = None
    maximum: float | None = None
    thresholds: tuple[tuple[float, str], ...] = ()  # (value, colour) steps above a green base
    repeat: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()  # (field name, unit)
    xy: tuple[str, str] | None = None  # xychart: (x field, y field)

    @property
    def instant(self) -> bool:
        """Single-value panels query one instant (the end of the range) rather than a range."""
        return self.kind in ("stat", "bargauge", "table")


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str  # label_values(...) for query variables; "prometheus" for the data source
    kind: Literal["datasource", "query"] = "query"
    multi: bool = True
    include_all: bool = True
    description: str = ""
    default_all: bool = False  # preselect "All" rather than Grafana's default, the first value


@dataclass(frozen=True)
class Dashboard:
    name: str  # file name without .json
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]


def sel(metric: str, matchers: str) -> str:
    return f"{metric}{{{matchers}}}"


# ---------------------------------------------------------------------------------------------------------
# Variables

DATASOURCE_VAR = Variable("datasource", "Data source", "prometheus", kind="datasource", multi=False,
                          include_all=False, description="The Prometheus that scrapes the exporters.")
JOB_VAR = Variable("job", "Job", "label_values(gpuenergy_build_info, job)", default_all=True,
                   description="Scrape jobs of gpu-energy-exporter (from gpuenergy_build_info).")
NODE_VAR = Variable("node", "Node", 'label_values(gpuenergy_build_info{job=~"$job"}, instance)',
                    description="Exporter targets (the instance label: one exporter per node).")
FLEET_NODE_VAR = dataclasses.replace(NODE_VAR, default_all=True)
GPU_VAR = Variable("gpu", "GPU", 'label_values(gpuenergy_gpu_info{job=~"$job", instance=~"$node"}, gpu)',
                   default_all=True,
                   description="NVML indices of the node's GPUs (not CUDA_VISIBLE_DEVICES indices).")
RUN_VAR = Variable("run_id", "Run", f"label_values({RUN_INFO.prometheus}, {ATTR_RUN_ID})", include_all=False,
                   description=f"Training runs that pushed their metadata ({RUN_INFO.prometheus}).")

FLEET = 'job=~"$job", instance=~"$node"'
NODE = 'job=~"$job", instance=~"$node"'
NODE_GPU = 'job=~"$job", instance=~"$node", gpu=~"$gpu"'
RUN = f'{ATTR_RUN_ID}=~"${RUN_VAR.name}"'
ONE_RUN = f'{ATTR_RUN_ID}="${RUN_VAR.name}"'  # inside a panel repeated per run
GPU_LEGEND = "{{instance}} GPU {{gpu}}"
RUN_LEGEND = f"{{{{{ATTR_RUN_ID}}}}}"


def ledger_sum(expr: str) -> str:
    """A per-run ledger series summed over nodes: first over the series of one scrape target (an extra
    label, such as the ledger's split of a shared GPU, adds up), then the max over the jobs that scrape
    that target (counted once), then the sum over nodes."""
    return f"sum by ({ATTR_RUN_ID}) (max by ({ATTR_RUN_ID}, instance) (sum by ({ATTR_RUN_ID}, instance, job) ({expr})))"


def ledger_active_seconds(expr: str) -> str:
    """Active seconds of the run (max over nodes: they are active at the same time); absent when 0."""
    return f"(max by ({ATTR_RUN_ID}) ({expr}) > 0)"


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
# J/token over the dashboard range: the ledgers' counters where they cover the run (energy and tokens
# counted over the same samples), else the recorded power and token rate averaged over the range. The
# fallback is for runs the ledgers do not know or know only in part (a multi-node run whose ranks all push
# to one exporter: that ledger has every rank's tokens but one node's energy). A token rate younger than
# its 5-minute window reads low, so without a ledger the fallback overstates J/token for a run that
# started inside the range.
RUN_JOULES_PER_TOKEN_RANGE = (
    f"{ledger_sum(_RUN_ENERGY_INCREASE)}"
    f" / ({ledger_sum(_RUN_TOKENS_INCREASE)} > 0)"
    f" and on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE}"
    f" or (avg_over_time({sel('run_id:gpuenergy_gpu_energy_joules:rate5m', RUN)}[$__range])"
    f" / (avg_over_time({sel('run_id:training_tokens:rate5m', RUN)}[$__range]) > 0)"
    f" unless on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE})"
)
# CO2 so far: the ledgers' running total where they cover the run, else the recorded CO2 rate summed
# minute by minute.
RUN_CO2_SO_FAR = (
    f"{ledger_sum(sel('gpuenergy_run_co2_grams', RUN))} and on ({ATTR_RUN_ID}) {RUN_LEDGER_COMPLETE}"
    f" or sum_over_time({sel('run_id:gpuenergy_gpu_co2_grams:rate5m', RUN)}[$__range:1m]) * 60"
)

# ---------------------------------------------------------------------------------------------------------
# Fleet overview

FLEET_DASHBOARD = Dashboard(
    name="fleet-overview",
    uid="gpuenergy-fleet-overview",
    title="GPU energy / Fleet overview",
    description="Power, energy, CO2 and utilisation of every GPU the exporters see; where the energy goes.",
    variables=(DATASOURCE_VAR, JOB_VAR, FLEET_NODE_VAR),
    rows=(
        Row("Now", (
            Panel("stat", "GPU power now",
                  "Total power of the selected nodes' GPUs over the last 5 minutes, from the GPU energy "
                  "counters (recording rule instance_gpu:gpuenergy_gpu_energy_joules:rate5m), each GPU "
                  "counted once by its UUID even when two scrape targets serve it.",
                  WATT, (Query("sum(max by (gpu_uuid) "
                               f"({sel('instance_gpu:gpuenergy_gpu_energy_joules:rate5m', FLEET)}))"),),
                  width=4, height=4),
            Panel("stat", "GPU energy today",
                  "Energy used by the selected nodes' GPUs since midnight (dashboard time zone), from the "
                  "energy counters, each GPU counted once by its UUID.",
                  KWH, (Query(f"sum(max by (gpu_uuid) (increase({sel('gpuenergy_gpu_energy_joules_total', FLEET)}"
                              "[$__range]))) / 3.6e6"),),
                  width=4, height=4, time_from="now/d"),
            Panel("stat", "GPU CO2 today",
                  "CO2-equivalent of the GPU energy since midnight: the per-node CO2 rate (energy x PUE x "
                  "grid intensity, recording rule instance_gpu:gpuenergy_gpu_co2_grams:rate5m, each GPU "
                  "counted once by its UUID) summed minute by minute, so a grid intensity that changes "
                  "during the day is weighted correctly.",
                  GRAM, (Query("sum(sum_over_time(max by (gpu_uuid) "
                               f"({sel('instance_gpu:gpuenergy_gpu_co2_grams:rate5m', FLEET)})[$__range:1m])) * 60"),),
                  width=4, height=4, time_from="now/d"),
            Panel("stat", "GPUs answering",
                  "GPUs whose last NVML sample succeeded (gpuenergy_gpu_up 1), each counted once by its UUID.",
                  COUNT, (Query(f"count(max by (gpu_uuid) ({sel('gpuenergy_gpu_up', FLEET)}) == 1) or vector(0)"),),
                  width=4, height=4),
            Panel("stat", "Exporters down",
                  "Exporter targets Prometheus failed to scrape at its last attempt (up 0). The list is in "
                  "the table at the bottom.",
                  COUNT, (Query(f"count({sel('up', FLEET)} == 0) or vector(0)"),),
                  width=4, height=4, thresholds=((1, "red"),)),
            Panel("stat", "GPUs lost / NVML unavailable",
                  "GPUs that stopped answering NVML (gpuenergy_gpu_up 0, each GPU once by its UUID) and "
                  "exporters that cannot use NVML at all (gpuenergy_nvml_available 0; see its reason label on "
                  "the node dashboard).",
                  COUNT, (Query(f"count(max by (gpu_uuid) ({sel('gpuenergy_gpu_up', FLEET)}) == 0) or vector(0)",
                                "GPUs lost"),
                          Query(f"count({sel('gpuenergy_nvml_available', FLEET)} == 0) or vector(0)",
                                "NVML unavailable")),
                  width=4, height=4, thresholds=((1, "red"),)),
        )),
        Row("Power, utilisation and carbon by node", (
            Panel("timeseries", "GPU power by node",
                  "Power of each node's GPUs together, from the energy counters over 5 minutes.",
                  WATT, (Query(sel("instance:gpuenergy_gpu_energy_joules:rate5m", FLEET), "{{instance}}"),)),
            Panel("timeseries", "GPU utilisation by node",
                  "Mean time-active utilisation of each node's GPUs (the fraction of time a kernel ran; "
                  "not how many SMs it kept busy).",
                  RATIO, (Query(f"avg by (instance) ({sel('gpuenergy_gpu_utilization_ratio', FLEET)})",
                                "{{instance}}"),),
                  minimum=0, maximum=1),
            Panel("timeseries", "GPU CO2 rate by node",
                  "Grams of CO2-equivalent per hour caused by each node's GPUs: power x PUE x grid "
                  "intensity (recording rule instance:gpuenergy_gpu_co2_grams:rate5m x 3600).",
                  GRAMS_PER_HOUR, (Query(f"{sel('instance:gpuenergy_gpu_co2_grams:rate5m', FLEET)} * 3600",
                                         "{{instance}}"),)),
            Panel("bargauge", "GPU energy by node (selected range)",
                  "Energy each node's GPUs used over the dashboard's time range.",
                  KWH, (Query("sort_desc(sum by (instance) "
                              f"(increase({sel('gpuenergy_gpu_energy_joules_total', FLEET)}[$__range])) / 3.6e6)",
                              "{{instance}}"),)),
        )),
        Row("Where the energy goes", (
            Panel("bargauge", "GPUs by utilisation (average over the range)",
                  "Every selected GPU's mean time-active utilisation over the dashboard range, busiest "
                  "first: the bottom of the list is idle hardware still drawing idle power.",
                  RATIO, (Query("sort_desc(avg_over_time("
                                f"{sel('gpuenergy_gpu_utilization_ratio', FLEET)}[$__range]))", GPU_LEGEND),),
                  width=8, height=10, minimum=0, maximum=1),
            Panel("bargauge", "Top runs by GPU energy (selected range)",
                  "The ten training runs whose GPUs used the most energy within the dashboard range: the "
                  "increase of the run ledgers' energy counters (gpuenergy_run_energy_joules_total, summed "
                  "over nodes), which start with the run and split a GPU shared by several runs, so each "
                  "joule is charged once and none from before the run. Fallback, for runs no ledger covers "
                  "completely (training data through another OTLP path, or a multi-node run whose ranks "
                  "all push to one exporter): the recorded run power (run_id:gpuenergy_gpu_energy_joules:"
                  "rate5m) summed minute by minute, which lags the run's start by the 5-minute window and "
                  "charges a shared GPU's whole energy to each run on it. Runs span nodes, so the node "
                  "filter does not apply.",
                  JOULE, (Query(f"topk(10, {ledger_sum('increase(gpuenergy_run_energy_joules_total[$__range])')}"
                                f" and on ({ATTR_RUN_ID}) max_over_time("
                                "run_id:gpuenergy_run_energy_joules:ledger_complete[$__range])"
                                " or sum_over_time(run_id:gpuenergy_gpu_energy_joules:rate5m[$__range:1m]) * 60)",
                                RUN_LEGEND),),
                  width=8, height=10),
            Panel("bargauge", "Top namespaces by GPU energy (selected range)",
                  "The ten Kubernetes namespaces whose pods' GPUs used the most energy within the range "
                  "(needs --collector.kubernetes; empty elsewhere).",
                  JOULE, (Query("topk(10, sum by (k8s_namespace) (increase("
                                f"{sel('gpuenergy_k8s_pod_energy_joules_total', FLEET)}[$__range])))",
                                "{{k8s_namespace}}"),),
                  width=8, height=10),
            Panel("table", "Exporters down",
                  "Exporter targets whose last scrape failed: the node's GPU energy is not being recorded.",
                  COUNT, (Query(f"{sel('up', FLEET)} == 0", "{{instance}}"),),
                  width=24, height=6),
        )),
    ),
)

# ---------------------------------------------------------------------------------------------------------
# Node and GPU detail

NODE_DASHBOARD = Dashboard(
    name="node-detail",
    uid="gpuenergy-node-detail",
    title="GPU energy / Node and GPU detail",
    description="Everything the exporter measures on one node: GPU power three ways, energy, memory, "
                "utilisation, GPM activity, temperatures, clocks and throttling, host CPU, RAM and RAPL.",
    variables=(DATASOURCE_VAR, JOB_VAR, NODE_VAR, GPU_VAR),
    rows=(
        Row("Power and energy", (
            Panel("timeseries", "GPU power: instant, 1 s average and from the energy counter",
                  "Instant power (NVML's instant field; on A100/H100 it sees ~25 ms of every 100 ms), the "
                  "driver's 1 s average, and the rate of the energy counter (exact over the interval, the "
                  "one to trust for energy), with the enforced power limit, the idle baseline the exporter "
                  "learned or was given, and on Grace Hopper the module power (GPU + Grace CPU + memory; "
                  "it includes the GPU: never add the two).",
                  WATT, (
                      Query(sel("gpuenergy_gpu_power_watts", NODE_GPU), f"{GPU_LEGEND} instant"),
                      Query(sel("gpuenergy_gpu_power_average_watts", NODE_GPU), f"{GPU_LEGEND} 1 s average"),
                      Query(f"rate({sel('gpuenergy_gpu_energy_joules_total', NODE_GPU)}[$__rate_interval])",
                            f"{GPU_LEGEND} energy counter"),
                      Query(sel("gpuenergy_gpu_power_limit_watts", NODE_GPU), f"{GPU_LEGEND} limit"),
                      Query(sel("gpuenergy_gpu_idle_power_watts", NODE_GPU),
                            f"{GPU_LEGEND} idle baseline ({{{{source}}}})"),
                      Query(sel("gpuenergy_gpu_module_power_watts", NODE_GPU), f"{GPU_LEGEND} module"),
                  ),
                  width=24, height=9),
            Panel("stat", "GPU energy (selected range)",
                  "Energy each GPU used over the dashboard range, from its energy counter.",
                  KWH, (Query(f"increase({sel('gpuenergy_gpu_energy_joules_total', NODE_GPU)}[$__range])"
                              " / 3.6e6", GPU_LEGEND),),
                  width=8),
            Panel("timeseries", "GPU energy counter",
                  "The exposed energy counter: NVML's counter (since driver load) kept monotonic across "
                  "driver reloads, or integrated instant power on GPUs without one (see energy_method in "
                  "gpuenergy_gpu_info).",
                  JOULE, (Query(sel("gpuenergy_gpu_energy_joules_total", NODE_GPU), GPU_LEGEND),),
                  width=16),
        )),
        Row("Memory and utilisation", (
            Panel("timeseries", "VRAM",
                  "Framebuffer memory in use (all processes), reserved by the driver, and the total.",
                  BYTES, (
                      Query(sel("gpuenergy_gpu_memory_used_bytes", NODE_GPU), f"{GPU_LEGEND} used"),
                      Query(sel("gpuenergy_gpu_memory_reserved_bytes", NODE_GPU), f"{GPU_LEGEND} reserved"),
                      Query(sel("gpuenergy_gpu_memory_total_bytes", NODE_GPU), f"{GPU_LEGEND} total"),
                  ),
                  width=16),
            Panel("bargauge", "VRAM in use",
                  "Used / total framebuffer memory now. The GPUMemoryAlmostFull alert fires above 95% for "
                  "5 minutes.",
                  RATIO, (Query(f"{sel('gpuenergy_gpu_memory_used_bytes', NODE_GPU)}"
                                f" / {sel('gpuenergy_gpu_memory_total_bytes', NODE_GPU)}", GPU_LEGEND),),
                  width=8, minimum=0, maximum=1, thresholds=((0.8, "orange"), (0.95, "red"))),
            Panel("timeseries", "Utilisation: time-active and memory controller",
                  "NVML utilisation: the fraction of the sample period in which any kernel ran (a GPU "
                  "running one tiny kernel all the time shows 100%), and the fraction the memory controller "
                  "was busy.",
                  RATIO, (
                      Query(sel("gpuenergy_gpu_utilization_ratio", NODE_GPU), f"{GPU_LEGEND} time-active"),
                      Query(sel("gpuenergy_gpu_memory_utilization_ratio", NODE_GPU),
                            f"{GPU_LEGEND} memory controller"),
                  ),
                  minimum=0, maximum=1),
            Panel("timeseries", "SM, tensor and DRAM activity (GPM)",
                  "NVML GPM metrics (Hopper and newer; empty on older GPUs and vGPU): fraction of SMs busy, "
                  "resident warps against the maximum, time the tensor cores issued work, graphics/compute "
                  "engine activity, and DRAM bandwidth against its peak.",
                  RATIO, (
                      Query(sel("gpuenergy_gpu_sm_active_ratio", NODE_GPU), f"{GPU_LEGEND} SM active"),
                      Query(sel("gpuenergy_gpu_sm_occupancy_ratio", NODE_GPU), f"{GPU_LEGEND} SM occupancy"),
                      Query(sel("gpuenergy_gpu_tensor_active_ratio", NODE_GPU), f"{GPU_LEGEND} tensor active"),
                      Query(sel("gpuenergy_gpu_graphics_active_ratio", NODE_GPU),
                            f"{GPU_LEGEND} graphics/compute active"),
                      Query(sel("gpuenergy_gpu_dram_bandwidth_utilization_ratio", NODE_GPU),
                            f"{GPU_LEGEND} DRAM bandwidth"),
                  ),
                  minimum=0, maximum=1),
        )),
        Row("Thermals, clocks and throttling", (
            Panel("timeseries", "Temperature",
                  "GPU die and HBM memory temperature. GPUTemperatureHigh fires above 85 °C for 5 minutes.",
                  CELSIUS, (
                      Query(sel("gpuenergy_gpu_temperature_celsius", NODE_GPU), f"{GPU_LEGEND} die"),
                      Query(sel("gpuenergy_gpu_memory_temperature_celsius", NODE_GPU), f"{GPU_LEGEND} memory"),
                  ),
                  width=8, thresholds=((85, "red"),)),
            Panel("timeseries", "Clocks",
                  "Current SM and memory clocks; a drop under load with a throttle reason active on the "
                  "right means the GPU is being slowed.",
                  HERTZ, (
                      Query(sel("gpuenergy_gpu_sm_clock_hertz", NODE_GPU), f"{GPU_LEGEND} SM"),
                      Query(sel("gpuenergy_gpu_memory_clock_hertz", NODE_GPU), f"{GPU_LEGEND} memory"),
                  ),
                  width=8),
            Panel("statetimeline", "Throttle reasons (clock events)",
                  "When each NVML clock-event reason was active (only reasons active at some point are "
                  "shown). Thermal reasons mean cooling trouble; hw_power_brake_slowdown an external power "
                  "brake; sw_power_cap running at the power limit (normal at full load).",
                  ON_OFF, (Query(f"{sel('gpuenergy_gpu_clock_event_active', NODE_GPU)} == 1",
                                 f"{GPU_LEGEND} {{{{reason}}}}"),),
                  width=8),
        )),
        Row("Host", (
            Panel("timeseries", "Host CPU utilisation",
                  "Fraction of all logical CPUs' time spent busy: data loading and tokenisation live here.",
                  RATIO, (Query(sel("gpuenergy_host_cpu_utilization_ratio", NODE), "{{instance}}"),),
                  width=8, minimum=0, maximum=1),
            Panel("timeseries", "Host memory",
                  "Physical RAM: total, available (what can be allocated without swapping), used, and the "
                  "critical threshold (--host.memory-critical, default 1 GiB) under which HostMemoryCritical "
                  "fires.",
                  BYTES, (
                      Query(sel("gpuenergy_host_memory_total_bytes", NODE), "{{instance}} total"),
                      Query(sel("gpuenergy_host_memory_available_bytes", NODE), "{{instance}} available"),
                      Query(sel("gpuenergy_host_memory_used_bytes", NODE), "{{instance}} used"),
                      Query(sel("gpuenergy_host_memory_critical_bytes", NODE), "{{instance}} critical threshold"),
                  ),
                  width=8),
            Panel("timeseries", "CPU and DRAM power (RAPL)",
                  "Power of each RAPL zone from its energy counter. Zones overlap: core and uncore "
                  "(scope package_part) are inside their package, psys (scope platform) covers everything; "
                  "CPU + memory power is the sum of scope package and scope dram only. Needs read access "
                  "to energy_uj (root, or see docs).",
                  WATT, (Query(f"rate({sel('gpuenergy_rapl_energy_joules_total', NODE)}[$__rate_interval])",
                               "{{instance}} package {{package}} {{domain}} ({{scope}})"),),
                  width=8),
        )),
        Row("Exporter health", (
            Panel("statetimeline", "NVML and collectors",
                  "Whether NVML is usable (with the reason when not) and whether each collector's last "
                  "update succeeded (a collector with nothing to read, such as RAPL without permission, "
                  "shows as off).",
                  ON_OFF, (
                      Query(sel("gpuenergy_nvml_available", NODE), "{{instance}} NVML {{reason}}"),
                      Query(sel("gpuenergy_collector_success", NODE), "{{instance}} collector {{collector}}"),
                  ),
                  width=16),
            Panel("timeseries", "Age of the last good GPU sample",
                  "Seconds since each GPU last answered; it grows while a GPU is lost or the sampler is "
                  "stuck in a hung driver call.",
                  SECONDS, (Query(sel("gpuenergy_gpu_last_sample_age_seconds", NODE_GPU), GPU_LEGEND),),
                  width=8),
        )),
    ),
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
                  "GPU joules per token over the part of the dashboard range in which the run was active: "
                  "the run ledgers' energy increase / token increase (both counters start with the run, so "
                  "the figure is right for a run that started or ended inside the range). Fallback, for "
                  "runs no ledger covers completely (training data through another OTLP path, or a "
                  "multi-node run whose ranks all push to one exporter, whose ledger has one node's "
                  "energy): mean run power / mean token rate, which without a ledger overstates J/token "
                  "when the run started less than 5 minutes before the range ends or inside it.",
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
                  "CO2-equivalent of the run's GPU energy: energy (kWh) x PUE x grid intensity, integrated "
                  "as it happened: the run ledgers' running total (gpuenergy_run_co2_grams, summed over "
                  "nodes) for runs they cover completely, else the recorded CO2 rate summed minute by "
                  "minute. GPU energy only: CPUs, memory, network and cooling beyond PUE are not included.",
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
                  "the tokens all its ranks processed, from the exporters' run ledgers (right from the "
                  "run's first minute). Runs without a ledger (training data through another OTLP path) "
                  "use the GPUs' power / token rate, which overstates J/token in the run's first 5 "
                  "minutes.",
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

DASHBOARDS: tuple[Dashboard, ...] = (FLEET_DASHBOARD, NODE_DASHBOARD, TRAINING_DASHBOARD)


# ---------------------------------------------------------------------------------------------------------
# Rendering with grafana-foundation-sdk


def _thresholds(steps: Sequence[tuple[float, str]]) -> dashboard.ThresholdsConfig:
    return dashboard.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=None, color="green")] + [dm.Threshold(value=v, color=c) for v, c in steps])


def _query(q: Query, ref: str, spec: Panel) -> prometheus.Dataquery:
    b = prometheus.Dataquery().expr(q.expr).ref_id(ref).datasource(DATASOURCE)
    if q.legend:
        b = b.legend_format(q.legend)
    if spec.kind == "table":
        b = b.format(prometheus_models.PromQueryFormat.TABLE)
    return b.instant() if spec.instant else b.range()


def _legend() -> common.VizLegendOptions:
    return (common.VizLegendOptions().display_mode(common_models.LegendDisplayMode.LIST)
            .placement(common_models.LegendPlacement.BOTTOM).show_legend(True))


def _panel(spec: Panel) -> Any:
    builder: Any
    if spec.kind == "timeseries":
        builder = (timeseries.Panel().legend(_legend()).tooltip(
            common.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)
            .sort(common_models.SortOrder.DESCENDING)).fill_opacity(10).line_width(1)
            .span_nulls(False))
    elif spec.kind == "stat":
        builder = (stat.Panel().graph_mode(common_models.BigValueGraphMode.NONE)
                   .color_mode(common_models.BigValueColorMode.VALUE)
                   .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    elif spec.kind == "bargauge":
        builder = (bargauge.Panel().display_mode(common_models.BarGaugeDisplayMode.GRADIENT)
                   .orientation(common_models.VizOrientation.HORIZONTAL)
                   .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    elif spec.kind == "table":
        builder = table.Panel()
    elif spec.kind == "statetimeline":
        builder = statetimeline.Panel().legend(_legend()).show_value(common_models.VisibilityMode.NEVER)
    else:
        assert spec.xy is not None
        x, y = spec.xy
        builder = (xychart.Panel().legend(_legend()).mapping(xychart_models.SeriesMapping.MANUAL)
                   .show(xychart_models.XYShowMode.POINTS_AND_LINES)
                   .series([xychart.XYSeriesConfig()
                            .frame(xychart.XychartXYSeriesConfigFrame().matcher(
                                xychart.MatcherConfig().id("byIndex").options(0)))
                            .x(xychart.XychartXYSeriesConfigX().matcher(
                                xychart.MatcherConfig().id("byName").options(x)))
                            .y(xychart.XychartXYSeriesConfigY().matcher(
                                xychart.MatcherConfig().id("byName").options(y)))])
                   .with_transformation(dm.DataTransformerConfig(
                       id_val="joinByField", options={"byField": "Time", "mode": "outer"})))
    builder = (builder.title(spec.title).description(spec.description).datasource(DATASOURCE)
               .unit(spec.unit).span(spec.width).height(spec.height))
    for i, q in enumerate(spec.queries):
        builder = builder.with_target(_query(q, chr(ord("A") + i), spec))
    if spec.time_from:
        builder = builder.time_from(spec.time_from)
    if spec.minimum is not None:
        builder = builder.min(spec.minimum)
    if spec.maximum is not None:
        builder = builder.max(spec.maximum)
    if spec.thresholds:
        builder = builder.thresholds(_thresholds(spec.thresholds))
    if spec.repeat:
        builder = builder.repeat(spec.repeat).repeat_direction("h").max_per_row(2)
    for name, unit in spec.overrides:
        builder = builder.override_by_name(name, [dm.DynamicConfigValue(id_val="unit", value=unit)])
    return builder


def _variable(v: Variable) -> Any:
    if v.kind == "datasource":
        return dashboard.DatasourceVariable(v.name).label(v.label).type(v.query).description(v.description)
    b = (dashboard.QueryVariable(v.name).label(v.label).description(v.description).query(v.query)
         .datasource(DATASOURCE).refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
         .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(v.multi).include_all(v.include_all))
    if v.default_all:
        b = b.current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
    return b


def render(spec: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana JSON (a plain dict)."""
    b = (dashboard.Dashboard(spec.title).uid(spec.uid).description(spec.description)
         .tags([TAG]).editable().timezone("browser").time("now-6h", "now").refresh("1m")
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .link(dashboard.DashboardLink("GPU energy dashboards").type(dm.DashboardLinkType.DASHBOARDS)
               .tags([TAG]).as_dropdown(True).include_vars(False).keep_time(True)))
    for v in spec.variables:
        b = b.with_variable(_variable(v))
    for row in spec.rows:
        b = b.with_row(dashboard.Row(row.title))
        for p in row.panels:
            b = b.with_panel(_panel(p))
    data: dict[str, Any] = json.loads(json.dumps(b.build(), cls=JSONEncoder))
    _layout(data["panels"])
    return data


def _layout(panels: list[dict[str, Any]]) -> None:
    """Place panels left to right, wrapping before one that would overflow the 24-column grid (the SDK
    only wraps after), and number them in that order so the JSON is stable from one build to the next."""
    x = y = row_height = 0
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
        pos = panel["gridPos"]
        if panel["type"] == "row" or x + pos["w"] > 24:
            y, x, row_height = y + row_height, 0, 0
        if panel["type"] == "row":
            panel["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
            continue
        panel["gridPos"] = {"h": pos["h"], "w": pos["w"], "x": x, "y": y}
        x += pos["w"]
        row_height = max(row_height, pos["h"])


def dashboard_json(spec: Dashboard) -> str:
    return json.dumps(render(spec), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Docs: the generated sections of docs/dashboards.md

def _md_code(expr: str) -> str:
    return f"```promql\n{expr}\n```"


def panels_markdown() -> str:
    out: list[str] = []
    for d in DASHBOARDS:
        out.append(f"### {d.title} (`dashboards/{d.name}.json`, uid `{d.uid}`)\n")
        out.append(f"{d.description}\n")
        out.append("Variables:\n\n" + "\n".join(
            f"- `${v.name}`: {v.description} Query: `{v.query}`." for v in d.variables) + "\n")
        for row in d.rows:
            out.append(f"#### {row.title}\n")
            for p in row.panels:
                extra = []
                if p.time_from:
                    extra.append(f"time range `{p.time_from}`")
                if p.repeat:
                    extra.append(f"repeated per `${p.repeat}`")
                extra_text = f"; {', '.join(extra)}" if extra else ""
                out.append(f"**{p.title}** ({p.kind}, unit `{p.unit}`{extra_text}). {p.description}\n")
                for q in p.queries:
                    legend = f"Legend `{q.legend}`:\n" if q.legend else ""
                    out.append(f"{legend}{_md_code(q.expr)}\n")
    return "\n".join(out)


_RULE_START = re.compile(r"^\s*- (?:record|alert): (\S+)")


def rule_comments(text: str) -> dict[str, str]:
    """The comment block written just above each rule in a rules file, by rule name: the rule's
    explanation lives once, next to the rule, and the docs quote it."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        m = _RULE_START.match(line)
        if m:
            comments[m.group(1)] = " ".join(block)
        block = []
    return comments


def rules_markdown() -> str:
    out: list[str] = []
    for path in sorted(RULES_DIR.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        comments = rule_comments(text)
        for group in yaml.safe_load(text)["groups"]:
            out.append(f"### Group `{group['name']}` (`dashboards/rules/{path.name}`)\n")
            for rule in group["rules"]:
                expr = rule["expr"].strip()
                if "record" in rule:
                    note = comments.get(rule["record"], "")
                    out.append(f"**`{rule['record']}`**{'. ' + note if note else ''}\n\n{_md_code(expr)}\n")
                else:
                    ann = rule.get("annotations", {})
                    note = comments.get(rule["alert"], "")
                    out.append(
                        f"**{rule['alert']}** (severity `{rule.get('labels', {}).get('severity', '')}`, "
                        f"for `{rule.get('for', '0s')}`). {note + ' ' if note else ''}"
                        f"Summary: {ann.get('summary', '')}\n\n{_md_code(expr)}\n")
    return "\n".join(out)


def _replace_section(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{DOCS} lacks the markers {begin} ... {end}")
    return text[: start + len(begin)] + "\n" + body.rstrip("\n") + "\n" + text[stop:]


def outputs() -> dict[Path, str]:
    """Every generated file and its expected content."""
    files = {DASHBOARD_DIR / f"{d.name}.json": dashboard_json(d) for d in DASHBOARDS}
    docs = DOCS.read_text(encoding="utf-8")
    docs = _replace_section(docs, "panels", panels_markdown())
    docs = _replace_section(docs, "rules", rules_markdown())
    files[DOCS] = docs
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, content in outputs().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == content:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(content, encoding="utf-8")
    for path in stale:
        verb = "out of date" if args.check else "wrote"
        print(f"{verb}: {path.relative_to(ROOT)}", file=sys.stderr if args.check else sys.stdout)
    if args.check and stale:
        print("run: python -m dashboards.build", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
