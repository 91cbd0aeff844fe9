"""What a dashboard is, as plain data: ``Query``, ``Panel``, ``Row``, ``Variable``, ``Dashboard``, the Grafana
unit ids, and the variables, matchers, legends and PromQL helpers the dashboards share.

Every panel is declared once as a ``Panel`` spec (``nodes.py``, ``training_run.py``): its PromQL, legend,
unit and description feed both the JSON (``render.py``) and the docs (``build.py``). Names of the training
contract (series, labels) come from ``gpu_energy_exporter.core.contract``, never retyped. This module never
imports grafana-foundation-sdk and never talks to Grafana or Prometheus.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from gpu_energy_exporter.core.contract import ATTR_RUN_ID

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
SHORT = "short"  # a plain number, scaled (K, Mil, Bil)
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
    #: What "All" sends (Grafana's default: every value found, as a regex; ".*" also matches series
    #: without the label, such as a model no engine names).
    all_value: str | None = None


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
# Variables, matchers and legends shared by the dashboards

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

FLEET = 'job=~"$job", instance=~"$node"'
NODE = 'job=~"$job", instance=~"$node"'
NODE_GPU = 'job=~"$job", instance=~"$node", gpu=~"$gpu"'
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

