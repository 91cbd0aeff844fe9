"""The Prometheus rules in dashboards/rules/: valid for promtool, every rule unit-tested with promtool
against hand-computed values, every alert actionable, every metric name one the code produces."""

from __future__ import annotations

import re

import pytest
import yaml

from dashboards import names, promtool
from dashboards.promql import metric_names, normalize

RECORD_NAME = re.compile(r"^[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z][a-z0-9_]*$")
SEVERITIES = {"critical", "warning", "info"}


def recorded_names() -> set[str]:
    return {r["record"] for r in promtool.rules() if "record" in r}


@pytest.fixture(scope="module")
def promtool_binary() -> str:
    try:
        return promtool.binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def test_rule_files_exist() -> None:
    assert [p.name for p in promtool.RULE_FILES] == ["alerts.yaml", "inference.yaml", "recording.yaml"]
    assert promtool.TEST_FILES, "no promtool test files under dashboards/tests/"


@pytest.mark.parametrize("path", promtool.RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(promtool_binary: str, path: object) -> None:
    result = promtool.run("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass(promtool_binary: str) -> None:
    result = promtool.run("test", "rules", *(p.name for p in promtool.TEST_FILES), cwd=promtool.ROOT / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(promtool.TEST_FILES), result.stdout


def test_promtool_unit_tests_can_fail(promtool_binary: str, tmp_path: object) -> None:
    # A wrong expected value must make promtool fail: guards against tests that assert nothing.
    from pathlib import Path

    src = promtool.ROOT / "tests" / "fleet_node_test.yaml"
    text = src.read_text(encoding="utf-8").replace("value: 562.5", "value: 562.75", 1)
    text = text.replace("../rules/", str(promtool.ROOT / "rules") + "/")
    broken = Path(str(tmp_path)) / "broken_test.yaml"
    broken.write_text(text, encoding="utf-8")
    result = promtool.run("test", "rules", str(broken))
    assert result.returncode != 0
    assert "562.75" in result.stdout + result.stderr or "5.6275E+02" in result.stdout + result.stderr


def test_recording_rule_names_follow_level_metric_operations() -> None:
    bad = [r for r in recorded_names() if not RECORD_NAME.match(r)]
    assert not bad, f"recording rules not named level:metric:operations: {bad}"


def test_every_recording_rule_has_a_promtool_test_with_expected_samples() -> None:
    tested = set()
    for t in promtool.expression_tests():
        if not t.samples:
            continue
        selected = metric_names(t.expr)
        # The test must evaluate the recorded series itself: `name` or `name{...}`.
        if len(selected) == 1 and normalize(t.expr).split(" ")[0] in selected:
            tested |= selected
    missing = sorted(recorded_names() - tested)
    assert not missing, f"recording rules without a promtool test of their output: {missing}"


def test_every_alert_is_tested_firing_and_silent() -> None:
    alerts = [r["alert"] for r in promtool.rules() if "alert" in r]
    tests = promtool.alert_tests()
    firing = {t.alertname for t in tests if t.alerts}
    silent = {t.alertname for t in tests if not t.alerts}
    assert not sorted(set(alerts) - firing), f"alerts never tested firing: {sorted(set(alerts) - firing)}"
    assert not sorted(set(alerts) - silent), f"alerts never tested silent: {sorted(set(alerts) - silent)}"
    assert not sorted((firing | silent) - set(alerts)), "tests of alerts that do not exist"


def test_alerts_say_what_to_do() -> None:
    for rule in promtool.rules():
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        ann = rule.get("annotations", {})
        assert ann.get("summary") and ann.get("description"), name
        # "what happened: what to do" -- the summary carries the action after a colon.
        assert ":" in ann["summary"], f"{name}: summary must say what to do after a colon"
        assert rule.get("for"), f"{name}: an alert without `for` fires on a single bad sample"


def test_every_name_in_the_rules_is_produced_or_recorded() -> None:
    known = names.produced_metric_names() | recorded_names() | set(names.PENDING)
    unknown: dict[str, str] = {}
    for rule in promtool.rules():
        for name in metric_names(rule["expr"]) - known:
            unknown.setdefault(name, str(rule.get("record") or rule.get("alert")))
    assert not unknown, f"metric names no part of the code produces: {unknown}"


def test_the_names_check_catches_an_unknown_name() -> None:
    known = names.produced_metric_names() | recorded_names()
    expr = "sum by (run_id) (rate(training_tokenz_total[5m])) / on (run_id) run_id:training_tokens:rate5m"
    assert metric_names(expr) - known == {"training_tokenz_total"}


def test_every_rule_is_explained_next_to_it() -> None:
    # The docs quote the comment above each rule (dashboards/build.py); a rule without one is undocumented.
    from dashboards.build import rule_comments

    for path in promtool.RULE_FILES:
        comments = rule_comments(path.read_text(encoding="utf-8"))
        for rule in promtool.rules([path]):
            if "record" in rule:
                assert comments.get(rule["record"]), f"{path.name}: {rule['record']} has no comment above it"


# ---------------------------------------------------------------------------------------------------------
# Mutation checks: a rule changed in a way that matters must make some promtool case fail. Each mutant is
# one edit of one rule file: one `[5m]` window narrowed to `[4m]` (the inputs must change slope inside some
# window, or every window reads the same rate), or one exclusion line dropped: `unless on (run_id) <series>`
# in recording.yaml (the inputs must have a run that the exclusion removes), `and on (namespace, pod)
# <series>` in inference.yaml (a pod the restriction leaves out: no energy, no CO2 figure).

#: The rule files whose windows and exclusion lines are mutated, with the exclusion lines of each.
_MUTATED = {
    "recording.yaml": re.compile(r"^[ \t]*unless on \(run_id\) [A-Za-z_:][A-Za-z0-9_:]*[ \t]*\n", re.MULTILINE),
    "inference.yaml": re.compile(r"^[ \t]*and on \(namespace, pod\) [A-Za-z_:][A-Za-z0-9_:]*[ \t]*\n", re.MULTILINE),
}


def _rule_mutants() -> list[tuple[str, str, str]]:
    """(rule file, name, mutated text) for every mutation the promtool cases must catch."""
    mutants: list[tuple[str, str, str]] = []
    for name, exclusion in _MUTATED.items():
        text = (promtool.ROOT / "rules" / name).read_text(encoding="utf-8")
        for m in re.finditer(r"\[5m\]", text):
            line = text.count("\n", 0, m.start()) + 1
            if text.splitlines()[line - 1].lstrip().startswith("#"):
                continue  # a comment: no promtool case can see it
            mutants.append((name, f"{name} line {line}: [5m] -> [4m]", text[: m.start()] + "[4m]" + text[m.end():]))
        for m in exclusion.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            mutants.append((name, f"{name} line {line}: dropped {m.group().strip()!r}",
                            text[: m.start()] + text[m.end():]))
    return mutants


def test_rule_mutants_are_found() -> None:
    # The generator finds what it claims to: every window and every exclusion line of each mutated file.
    mutants = _rule_mutants()
    for name, exclusion in _MUTATED.items():
        text = (promtool.ROOT / "rules" / name).read_text(encoding="utf-8")
        names = [label for file, label, _ in mutants if file == name]
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert sum("[4m]" in n for n in names) == code.count("[5m]") > 0, name
        assert sum("dropped" in n for n in names) == len(exclusion.findall(text)) > 0, name


def test_every_rule_mutant_fails_a_promtool_case(promtool_binary: str, tmp_path: object) -> None:
    from pathlib import Path

    tmp = Path(str(tmp_path))
    (tmp / "rules").mkdir()
    (tmp / "tests").mkdir()
    for path in promtool.RULE_FILES:
        (tmp / "rules" / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    for path in promtool.TEST_FILES:
        (tmp / "tests" / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp / "rules" / "optional").mkdir()
    for path in promtool.OPTIONAL_RULE_FILES:  # the optional rules' own test file reads them
        (tmp / "rules" / "optional" / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    # The unmutated copy passes, so a failure below is the mutation's doing.
    files = [p.name for p in promtool.TEST_FILES]
    baseline = promtool.run("test", "rules", *files, cwd=tmp / "tests")
    assert baseline.returncode == 0, baseline.stdout + baseline.stderr
    # Each mutant is run against the test files that load its rule file (the others cannot see it).
    loading = {name: [p.name for p in promtool.TEST_FILES if f"../rules/{name}" in
                      (yaml.safe_load(p.read_text(encoding="utf-8")).get("rule_files") or [])] for name in _MUTATED}
    assert all(loading.values()), loading
    survivors = []
    for name, label, mutated in _rule_mutants():
        (tmp / "rules" / name).write_text(mutated, encoding="utf-8")
        result = promtool.run("test", "rules", *loading[name], cwd=tmp / "tests")
        if result.returncode == 0:
            survivors.append(label)
        (tmp / "rules" / name).write_text((promtool.ROOT / "rules" / name).read_text(encoding="utf-8"),
                                          encoding="utf-8")
    assert not survivors, "rule mutations no promtool case catches:\n" + "\n".join(survivors)
