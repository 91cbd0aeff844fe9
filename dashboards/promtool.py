"""Reading the promtool unit-test files under dashboards/tests/ and running promtool on them.

The tests use this to check coverage (every rule and every dashboard expression has a test with an
expected value) and to run ``promtool check rules`` / ``promtool test rules``. It never edits a rule or
test file and never talks to a Prometheus server.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dashboards.promql import normalize

ROOT = Path(__file__).resolve().parent
RULE_FILES = tuple(sorted((ROOT / "rules").glob("*.yaml")))
#: Rule files a user loads by choice (dashboards/rules/optional/), tested like the others.
OPTIONAL_RULE_FILES = tuple(sorted((ROOT / "rules" / "optional").glob("*.yaml")))
TEST_FILES = tuple(sorted((ROOT / "tests").glob("*.yaml")))

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:\\.|[^"\\])*)"')


@dataclass(frozen=True)
class ExprTest:
    """One ``promql_expr_test`` entry."""

    file: str
    expr: str
    eval_time: str
    samples: tuple[dict[str, str], ...]  # expected label sets, ``__name__`` included when named

    @property
    def key(self) -> str:
        return normalize(self.expr)


@dataclass(frozen=True)
class AlertTest:
    """One ``alert_rule_test`` entry."""

    file: str
    alertname: str
    eval_time: str
    alerts: tuple[dict[str, Any], ...]


def parse_labels(text: str) -> dict[str, str]:
    """``name{a="b"}`` or ``{a="b"}`` -> ``{"__name__": "name", "a": "b"}``."""
    text = text.strip()
    brace = text.find("{")
    name = text if brace < 0 else text[:brace].strip()
    labels = dict(_LABEL.findall(text[brace:])) if brace >= 0 else {}
    if name:
        labels["__name__"] = name
    return labels


def _load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(doc, dict), f"{path}: not a promtool test file"
    return doc


def expression_tests(files: Sequence[Path] = TEST_FILES) -> list[ExprTest]:
    out = []
    for path in files:
        for group in _load(path).get("tests", []):
            for t in group.get("promql_expr_test", []) or []:
                samples = tuple(parse_labels(s["labels"]) for s in t.get("exp_samples") or [])
                out.append(ExprTest(path.name, t["expr"], str(t["eval_time"]), samples))
    return out


def alert_tests(files: Sequence[Path] = TEST_FILES) -> list[AlertTest]:
    out = []
    for path in files:
        for group in _load(path).get("tests", []):
            for t in group.get("alert_rule_test", []) or []:
                out.append(AlertTest(path.name, t["alertname"], str(t["eval_time"]),
                                     tuple(t.get("exp_alerts") or [])))
    return out


def rules(files: Sequence[Path] = RULE_FILES) -> list[dict[str, Any]]:
    """Every rule of every group, as written (``record``/``alert``, ``expr``, ...)."""
    out = []
    for path in files:
        for group in _load(path)["groups"]:
            out.extend(group["rules"])
    return out


def binary() -> str:
    """The promtool executable; raises FileNotFoundError saying how to get one."""
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not found:
        raise FileNotFoundError(
            "promtool not found: install Debian's prometheus package (.ci/setup-test-env does) or set PROMTOOL")
    return found


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``promtool <args>``, capturing its output (never raises on a non-zero exit)."""
    return subprocess.run([binary(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
