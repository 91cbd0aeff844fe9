"""Rendering a ``Dashboard`` spec as Grafana JSON (Grafana 11.6 schema) with grafana-foundation-sdk.

Deterministic: sorted keys, panel ids numbered in layout order, no timestamps, no version counters. This
module never decides what a panel shows (that is the spec's) and never talks to Grafana.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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

from dashboards.spec import Dashboard, Panel, Query, Variable

TAG = "gpu-energy-exporter"
#: Every panel and query reads the data source the ``$datasource`` variable names: no data source UID is
#: ever written into a dashboard, so it imports into any Grafana.
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: The import input (grafana.com and Grafana's "Import dashboard" ask for it): on import Grafana replaces
#: ``${DS_PROMETHEUS}`` with the chosen data source, which becomes the ``$datasource`` variable's default.
#: Provisioned copies (the Kubernetes ConfigMaps, deploy/generate.py) have no import step: there the
#: variable defaults to Grafana's default data source instead.
DS_INPUT = "DS_PROMETHEUS"
#: The Grafana version whose schema the SDK writes (schemaVersion 41).
GRAFANA_VERSION = "11.6.0"
_PANEL_PLUGINS = {"timeseries": "Time series", "stat": "Stat", "bargauge": "Bar gauge", "table": "Table",
                  "state-timeline": "State timeline", "xychart": "XY Chart"}


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
        ref = "${" + DS_INPUT + "}"
        return (dashboard.DatasourceVariable(v.name).label(v.label).type(v.query).description(v.description)
                .current(dm.VariableOption(selected=True, text=ref, value=ref)))
    b = (dashboard.QueryVariable(v.name).label(v.label).description(v.description).query(v.query)
         .datasource(DATASOURCE).refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
         .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(v.multi).include_all(v.include_all))
    if v.default_all:
        b = b.current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
    if v.all_value is not None:
        b = b.all_value(v.all_value)
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
    data.update(_import_header(data))
    return data


def _import_header(data: dict[str, Any]) -> dict[str, Any]:
    """What grafana.com and Grafana's import read: the data source to ask for (``__inputs``), the Grafana
    version and plugins the dashboard needs (``__requires``), and no database id."""
    plugins = sorted({p["type"] for p in data["panels"] if p["type"] != "row"})
    requires = [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_VERSION},
                {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}]
    requires += [{"type": "panel", "id": p, "name": _PANEL_PLUGINS[p], "version": ""} for p in plugins]
    inputs = [{"name": DS_INPUT, "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
               "pluginName": "Prometheus",
               "description": "The Prometheus that scrapes gpu-energy-exporter and evaluates its recording rules."}]
    return {"__inputs": inputs, "__requires": requires}


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


def provisioning(data: dict[str, Any]) -> dict[str, Any]:
    """The dashboard as file provisioning must get it: provisioning has no import step to fill in
    ``${DS_PROMETHEUS}``, so the import header goes and the data source variable defaults to Grafana's
    default data source. (deploy/generate.py makes the same form for the sidecar ConfigMaps.)"""
    out = {k: v for k, v in data.items() if k not in ("__inputs", "__requires")}
    out["templating"] = {**out["templating"], "list": [
        {**v, "current": {"selected": True, "text": "default", "value": "default"}} if v["type"] == "datasource"
        else v for v in out["templating"]["list"]]}
    return out


def dashboard_json(spec: Dashboard, *, provisioned: bool = False) -> str:
    data = render(spec)
    return json.dumps(provisioning(data) if provisioned else data, indent=2, sort_keys=True,
                      ensure_ascii=False) + "\n"

