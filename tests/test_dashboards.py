"""The Grafana dashboards in dashboards/: rebuilt from code and identical to the committed JSON, every
panel's PromQL covered by a promtool test with hand-computed values, units and legends in place, and every
metric name one the exporter or the training helper produces."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dashboards import build, names, promtool, render
from dashboards.promql import metric_names, normalize, substitute, tokens, variable_query_metric_names

#: How the promtool tests spell the dashboards' variables (see the header of each dashboards/tests file).
#: Multi-value variables get a regex of two values, as Grafana sends them.
TEST_VARIABLES = {
    "job": "gpu-energy-exporter",
    "node": "node-a:9863|node-c:9863",
    "gpu": "0",
    "run_id": "run-a|run-b",
    "namespace": "serve|lab",
    "server": "vllm|tgi",
    "model": "llama-3-8b|llama-3-70b",
    "__range": "1h",
    "__range_s": "3600",
    "__rate_interval": "5m",
    "__interval": "1m",
}
#: A panel repeated per value of a variable sees one value at a time.
REPEAT_VALUES = {"run_id": "run-a"}
BUILTINS = {"__range", "__range_s", "__rate_interval", "__interval"}
#: Labels that identify what a series is about; a legend must show every one the result carries.
IDENTITY_LABELS = ("instance", "gpu", "run_id", "k8s_namespace", "namespace", "pod", "model", "server")

LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def committed(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((build.DASHBOARD_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])  # a collapsed row keeps its panels inside
        else:
            yield panel


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def test_expr(panel: dict[str, Any], target: dict[str, Any]) -> str:
    values = dict(TEST_VARIABLES)
    if panel.get("repeat"):
        values[panel["repeat"]] = REPEAT_VALUES[panel["repeat"]]
    return substitute(target["expr"], values)


test_expr.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test


def uncovered(expressions: dict[str, str], tests: list[promtool.ExprTest]) -> list[str]:
    """Descriptions of the expressions (description -> PromQL) that no promtool test with expected
    samples evaluates."""
    tested = {t.key for t in tests if t.samples}
    return [where for where, expr in expressions.items() if normalize(expr) not in tested]


ALL = [(d.name, committed(d.name)) for d in build.DASHBOARDS]


def all_panel_exprs() -> dict[str, str]:
    out = {}
    for name, dash in ALL:
        for panel, target in targets(dash):
            # The panel id too: two panels may share a title (the MFU stat and the MFU time series).
            out[f"{name}: {panel['title']} (panel {panel['id']}) [{target['refId']}]"] = test_expr(panel, target)
    return out


def test_committed_files_match_a_fresh_build() -> None:
    stale = [str(p.relative_to(build.ROOT)) for p, content in build.outputs().items()
             if not p.exists() or p.read_text(encoding="utf-8") != content]
    assert not stale, f"out of date (run `python -m dashboards.build`): {stale}"


def test_build_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # --check on a copy where one dashboard was edited by hand: exit 1, names the file, writes nothing.
    copy = tmp_path / "dashboards"
    copy.mkdir()
    for d in build.DASHBOARDS:
        (copy / f"{d.name}.json").write_text(render.dashboard_json(d), encoding="utf-8")
    edited = copy / "fleet-overview.json"
    edited.write_text(edited.read_text(encoding="utf-8").replace("GPU power now", "GPU power"), encoding="utf-8")
    docs = tmp_path / "dashboards.md"
    docs.write_text(build.DOCS.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(build, "DASHBOARD_DIR", copy)
    monkeypatch.setattr(build, "DOCS", docs)
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.main(["--check"]) == 1
    assert "fleet-overview.json" in capsys.readouterr().err
    assert "GPU power now" not in edited.read_text(encoding="utf-8")
    assert build.main([]) == 0
    assert "GPU power now" in edited.read_text(encoding="utf-8")
    assert build.main(["--check"]) == 0


def test_build_is_deterministic() -> None:
    first = [render.dashboard_json(d) for d in build.DASHBOARDS]
    second = [render.dashboard_json(d) for d in build.DASHBOARDS]
    assert first == second
    for text in first:
        data = json.loads(text)
        assert "version" not in data and "iteration" not in data and "id" not in data


@pytest.mark.parametrize(("name", "dash"), ALL, ids=[n for n, _ in ALL])
def test_dashboard_shape(name: str, dash: dict[str, Any]) -> None:
    assert dash["schemaVersion"] >= 41  # Grafana 11.6 schema
    assert dash["uid"].startswith("gpuenergy-") and len(dash["uid"]) <= 40
    assert render.TAG in dash["tags"]
    ids = [p["id"] for p in dash["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    for panel in panels(dash):
        where = f"{name}: {panel['title']}"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        assert panel.get("description"), f"{where}: no description"
        assert panel["gridPos"]["w"] > 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(refs), f"{where}: refIds {refs}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", where
            assert target["instant"] is (panel["type"] in ("stat", "bargauge", "table")), where


@pytest.mark.parametrize(("name", "dash"), ALL, ids=[n for n, _ in ALL])
def test_variables(name: str, dash: dict[str, Any]) -> None:
    defined = {v["name"]: v for v in dash["templating"]["list"]}
    assert defined["datasource"]["type"] == "datasource" and defined["datasource"]["query"] == "prometheus"
    expected = {"fleet-overview": {"job", "node"}, "node-detail": {"job", "node", "gpu"},
                "training-run": {"run_id"}, "inference": {"namespace", "server", "model"}}[name]
    assert expected <= set(defined)
    if "node" in defined:
        assert defined["node"]["query"].endswith(", instance)")
    used: set[str] = set()
    for _panel, target in targets(dash):
        used |= {text.strip("${}[]").split(":")[0] for kind, text in tokens(target["expr"]) if kind == "var"}
        used |= set(re.findall(r"\$(\w+)", target["expr"]))
    assert used - BUILTINS <= set(defined), f"undefined variables: {used - BUILTINS - set(defined)}"
    for v in defined.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"


def test_every_panel_expression_has_a_promtool_test() -> None:
    missing = uncovered(all_panel_exprs(), promtool.expression_tests())
    assert not missing, "panel queries without a promtool test (dashboards/tests/*.yaml) of the same " \
                        "expression, variables replaced as in TEST_VARIABLES:\n" + "\n".join(missing)


def test_the_coverage_check_can_fail() -> None:
    tests = promtool.expression_tests()
    covered = all_panel_exprs()
    some = next(iter(covered))
    assert uncovered({some: covered[some]}, tests) == []
    # Same query with one matcher changed, and a test that expects nothing: both count as uncovered.
    changed = covered[some].replace('job=~"gpu-energy-exporter"', 'job="gpu-energy-exporter"')
    assert changed != covered[some]
    assert uncovered({"changed": changed}, tests) == ["changed"]
    empty = promtool.ExprTest("x", "up", "0m", ())
    assert uncovered({"empty": "up"}, [empty]) == ["empty"]


def test_legends_show_the_node_and_every_identifying_label() -> None:
    # The promtool tests say which labels each query returns: the legend must show the node (instance),
    # GPU, run or namespace whenever the result carries them, and name no label the result never has.
    by_expr: dict[str, list[dict[str, str]]] = {}
    for t in promtool.expression_tests():
        by_expr.setdefault(t.key, []).extend(t.samples)
    problems = []
    for name, dash in ALL:
        for panel, target in targets(dash):
            if panel["type"] == "table":
                continue
            samples = by_expr[normalize(test_expr(panel, target))]
            legend = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
            present = {k for s in samples for k in s}
            where = f"{name}: {panel['title']} [{target['refId']}]"
            for label in IDENTITY_LABELS:
                if label in present and label not in legend:
                    problems.append(f"{where}: result has {label} but the legend does not show it")
            if legend - present:
                problems.append(f"{where}: legend names {sorted(legend - present)}, never in the result")
    assert not problems, "\n".join(problems)


def test_every_metric_name_is_produced_by_the_code() -> None:
    recorded = {r["record"] for r in promtool.rules() if "record" in r}
    known = names.produced_metric_names() | recorded | set(names.PENDING)
    unknown = []
    for name, dash in ALL:
        for panel, target in targets(dash):
            unknown += [f"{name}: {panel['title']}: {m}" for m in metric_names(target["expr"]) - known]
        for v in dash["templating"]["list"]:
            if v["type"] == "query":
                unknown += [f"{name}: ${v['name']}: {m}" for m in variable_query_metric_names(v["query"]) - known]
    assert not unknown, "metric names that neither the exporter nor the training helper produces:\n" + \
        "\n".join(unknown)


def test_pending_names_are_still_pending() -> None:
    # Once the code produces a pending name, it must leave names.PENDING (so the check above is strict).
    produced = names.produced_metric_names() & set(names.PENDING)
    assert not produced, f"now produced by the code; delete from dashboards/names.py PENDING: {sorted(produced)}"


def test_produced_names_come_from_the_code() -> None:
    exporter = names.exporter_metric_names()
    training = names.training_metric_names()
    # Spot checks that the catalogue was really loaded (collector modules imported) and translated.
    assert {"gpuenergy_gpu_energy_joules_total", "gpuenergy_host_memory_available_bytes",
            "gpuenergy_rapl_energy_joules_total", "gpuenergy_gpu_peak_flops_per_second"} <= exporter
    assert {"training_tokens_total", "training_run_gpu_info", "training_step_duration_seconds_bucket",
            "training_step_duration_seconds_count"} <= training
    assert "training_step_duration_seconds" not in training  # histograms only as their series


@pytest.mark.parametrize(("expr", "expected"), [
    ("sum by (instance) (rate(a_total{job=~\"x\"}[5m]))", {"a_total"}),
    ("sum(b) without (gpu) / on (gpu_uuid) group_left (precision) max by (x) (c)", {"b", "c"}),
    ("topk(10, sum_over_time(run_id:x:rate5m[$__range:1m]) * 60) or vector(0)", {"run_id:x:rate5m"}),
    ("histogram_quantile(0.95, sum by (le) (rate(h_bucket[5m])))", {"h_bucket"}),
    ("abs(loss) == +Inf and loss != loss unless bool_metric offset 5m", {"loss", "bool_metric"}),
    ('up{job="a{b}"} == 0', {"up"}),
])
def test_metric_name_extraction(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def test_variable_query_extraction() -> None:
    assert variable_query_metric_names('label_values(gpuenergy_gpu_info{instance=~"$node"}, gpu)') == \
        {"gpuenergy_gpu_info"}
    assert variable_query_metric_names("label_values(training_run_info, run_id)") == {"training_run_info"}


def test_substitution_refuses_unknown_variables() -> None:
    with pytest.raises(KeyError):
        substitute('up{instance=~"$nodes"}', TEST_VARIABLES)
    assert substitute("rate(x[$__rate_interval]) * $__range_s", TEST_VARIABLES) == "rate(x[5m]) * 3600"


def test_docs_list_every_panel_with_its_promql() -> None:
    text = build.DOCS.read_text(encoding="utf-8")
    for name, dash in ALL:
        for panel, target in targets(dash):
            assert f"**{panel['title']}**" in text, panel["title"]
            assert target["expr"] in text, f"{name}: {panel['title']}: PromQL missing from the docs"
