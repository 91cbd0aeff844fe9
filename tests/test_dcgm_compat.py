"""The optional dcgm-exporter compatibility rules (dashboards/rules/optional/dcgm-compat.yaml): valid for
promtool, every recorded series tested by promtool against hand values (dashboards/tests/dcgm_compat_test.yaml,
which tests/test_rules.py runs with the other promtool files), every name dcgm-exporter's Grafana dashboard
(grafana.com 12239) reads is recorded, with the labels it filters and draws by, from series the code
produces, and the rules ship in the kustomize tree as an optional component."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dashboards import names, promtool
from dashboards.build import rule_comments
from dashboards.promql import metric_names

REPO = Path(__file__).resolve().parent.parent
COMPAT = promtool.ROOT / "rules" / "optional" / "dcgm-compat.yaml"
TEST_FILE = promtool.ROOT / "tests" / "dcgm_compat_test.yaml"

#: What the issue asks for and what grafana.com dashboard 12239 ("NVIDIA DCGM Exporter Dashboard", the
#: dashboard in NVIDIA/dcgm-exporter's grafana/ folder) queries: temperature, power, SM clock, utilisation,
#: framebuffer used and tensor-core activity, each filtered by `instance` and `gpu` and drawn as "GPU {{gpu}}".
REQUIRED = {
    "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
}
DASHBOARD_12239_LABELS = {"instance", "gpu"}
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id", "DCGM_FI_DRIVER_VERSION"}


def _compat_rules() -> list[dict]:
    return promtool.rules([COMPAT])


def test_the_compat_file_is_optional_and_found() -> None:
    assert promtool.OPTIONAL_RULE_FILES == (COMPAT,)
    assert COMPAT not in promtool.RULE_FILES  # not loaded with dashboards/rules/*.yaml


def test_promtool_accepts_the_compat_rules() -> None:
    try:
        promtool.binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    result = promtool.run("check", "rules", str(COMPAT))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_dcgm_name_the_issue_and_dashboard_12239_need_is_recorded() -> None:
    recorded = {r["record"] for r in _compat_rules()}
    assert REQUIRED <= recorded, sorted(REQUIRED - recorded)


def test_every_compat_series_is_tested_with_dcgm_labels_and_hand_values() -> None:
    tests = {t.expr: t for t in promtool.expression_tests([TEST_FILE])}
    for rule in _compat_rules():
        name = rule["record"]
        assert name in tests, f"{name}: no promtool case in {TEST_FILE.name}"
        samples = tests[name].samples
        assert samples, f"{name}: the promtool case expects nothing"
        for labels in samples:
            assert labels["__name__"] == name
            assert DCGM_LABELS | DASHBOARD_12239_LABELS <= set(labels), (name, sorted(labels))


def test_the_test_file_runs_with_the_suites_promtool_files() -> None:
    # tests/test_rules.py runs `promtool test rules` on promtool.TEST_FILES: this file must be one of them.
    assert TEST_FILE in promtool.TEST_FILES
    doc = yaml.safe_load(TEST_FILE.read_text(encoding="utf-8"))
    assert doc["rule_files"] == ["../rules/optional/dcgm-compat.yaml"]


def test_a_wrong_unit_makes_the_promtool_case_fail(tmp_path: Path) -> None:
    # Guard against a case that cannot fail: MiB computed with 10^6 instead of 2^20 must be caught.
    try:
        promtool.binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    rules = tmp_path / "dcgm-compat.yaml"
    rules.write_text(COMPAT.read_text(encoding="utf-8").replace("/ 1048576", "/ 1000000"), encoding="utf-8")
    test = tmp_path / "t.yaml"
    test.write_text(TEST_FILE.read_text(encoding="utf-8").replace("../rules/optional/dcgm-compat.yaml", str(rules)),
                    encoding="utf-8")
    result = promtool.run("test", "rules", str(test))
    assert result.returncode != 0
    assert "DCGM_FI_DEV_FB_USED" in result.stdout + result.stderr


def test_compat_rules_read_only_series_the_code_produces() -> None:
    known = names.produced_metric_names() | {r["record"] for r in _compat_rules()}
    unknown = {r["record"]: sorted(metric_names(r["expr"]) - known) for r in _compat_rules()}
    assert not {k: v for k, v in unknown.items() if v}


def test_every_compat_rule_is_explained_next_to_it() -> None:
    comments = rule_comments(COMPAT.read_text(encoding="utf-8"))
    for rule in _compat_rules():
        assert comments.get(rule["record"]), f"{rule['record']} has no comment above it"


def test_the_kustomize_component_ships_exactly_the_compat_rules(tmp_path: Path) -> None:
    from test_deploy_manifests import K8S, generate, kustomize

    component = K8S / "components" / "dcgm-compat"
    assert not generate.differences(generate.render_optional(), component), "run python deploy/generate.py"
    rel = os.path.relpath(K8S, tmp_path)  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{rel}/base"], "components": [f"{rel}/components/dcgm-compat"]}))
    docs = kustomize(tmp_path)
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert sorted(d["metadata"]["name"] for d in rules) == ["gpu-energy-exporter", "gpu-energy-exporter-dcgm-compat"]
    compat = next(d for d in rules if d["metadata"]["name"] == "gpu-energy-exporter-dcgm-compat")
    assert compat["metadata"]["namespace"] == "gpu-energy-exporter"
    assert compat["spec"]["groups"] == yaml.safe_load(COMPAT.read_text(encoding="utf-8"))["groups"]
