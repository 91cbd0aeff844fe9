"""The bundled dashboards import into any Grafana (Dashboards > Import, or grafana.com): no data source UID
is written anywhere, every panel reads the ``$datasource`` variable, and the import header
(``__inputs``/``__requires``) asks for one Prometheus, as grafana.com's published dashboards do. The
Kubernetes ConfigMaps carry the provisioning form (tests/test_deploy_manifests.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dashboards import render

DASHBOARDS = sorted((Path(__file__).resolve().parent.parent / "dashboards").glob("*.json"))
VARIABLE_REF = {"type": "prometheus", "uid": "${datasource}"}
INPUT = "${DS_PROMETHEUS}"


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_all_four_dashboards_are_checked() -> None:
    assert [p.name for p in DASHBOARDS] == ["fleet-overview.json", "inference.json", "node-detail.json",
                                            "training-run.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_no_hard_coded_data_source_uid(path: Path) -> None:
    model = json.loads(path.read_text(encoding="utf-8"))
    refs = 0
    for where, node in _walk(model):
        if "datasource" in node:
            ref = node["datasource"]
            assert ref == VARIABLE_REF, f"{path.name}{where}: datasource {ref!r}"
            refs += 1
        if "uid" in node and where:  # the dashboard's own uid (top level) names the dashboard, not a source
            assert node["uid"] == "${datasource}", f"{path.name}{where}: uid {node['uid']!r}"
    assert refs > 10


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_import_header_asks_for_one_prometheus(path: Path) -> None:
    model = json.loads(path.read_text(encoding="utf-8"))
    assert model["__inputs"] == [{
        "name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
        "pluginName": "Prometheus", "description": model["__inputs"][0]["description"]}]
    assert "id" not in model  # a database id would make import overwrite another dashboard
    requires = {(r["type"], r["id"]) for r in model["__requires"]}
    panel_types = {p["type"] for p in model["panels"] if p["type"] != "row"}
    assert requires == {("grafana", "grafana"), ("datasource", "prometheus")} | {("panel", t) for t in panel_types}
    grafana = next(r for r in model["__requires"] if r["type"] == "grafana")
    assert grafana["version"] == render.GRAFANA_VERSION
    # The input is used once: as the default of the data source variable.
    assert path.read_text(encoding="utf-8").count(INPUT) == 2  # the variable's current text and value
    ds_var = next(v for v in model["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["name"] == "datasource" and ds_var["query"] == "prometheus"
    assert ds_var["current"] == {"selected": True, "text": INPUT, "value": INPUT}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_importing_makes_the_chosen_source_the_default_and_keeps_the_variable(path: Path) -> None:
    # What Grafana's import does with the chosen data source: replaces ${DS_PROMETHEUS} in the JSON text.
    model = json.loads(path.read_text(encoding="utf-8").replace(INPUT, "P1809F7CD0C75ACF3"))
    ds_var = next(v for v in model["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["current"]["value"] == "P1809F7CD0C75ACF3"
    for where, node in _walk(model):
        if "datasource" in node:
            assert node["datasource"] == VARIABLE_REF, where  # the user can still switch sources


def test_file_provisioning_form_is_the_sidecar_form(tmp_path: Path) -> None:
    # `python -m dashboards.build --provisioning DIR` (docs/dashboards.md, file provisioning) writes what the
    # sidecar ConfigMaps carry: no ${DS_PROMETHEUS} left for Grafana to choke on, the variable on "default".
    import yaml

    from dashboards import build

    assert build.main(["--provisioning", str(tmp_path)]) == 0
    configmaps = yaml.safe_load_all((Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "base" /
                                     "generated" / "dashboards.yaml").read_text(encoding="utf-8"))
    shipped = {k: v for d in configmaps if d for k, v in d["data"].items()}
    for path in DASHBOARDS:
        text = (tmp_path / path.name).read_text(encoding="utf-8")
        assert INPUT not in text
        assert text == shipped[path.name]
