"""Build the bundled Grafana dashboards and the generated parts of docs/dashboards.md.

``python -m dashboards.build`` writes ``dashboards/<name>.json`` (Grafana 11.6 schema, built with
grafana-foundation-sdk) and replaces the generated sections of ``docs/dashboards.md`` (panel reference,
rule reference). ``--check`` writes nothing and exits 1 when a file is out of date. The output is
deterministic: sorted keys, fixed panel ids, no timestamps, no version counters.

Every panel is declared once as a ``Panel`` spec (``dashboards/spec.py``; the panels in ``nodes.py``,
``training_run.py`` and ``inference.py``): its PromQL, legend, unit and description feed both the JSON
(``render.py``) and the docs (here). Expressions use the recording rules of ``dashboards/rules/*.yaml`` wherever
a join repeats; each one must have a promtool test in ``dashboards/tests/`` (tests/test_dashboards.py
checks that). This module never talks to Grafana or Prometheus.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from dashboards.inference import INFERENCE_DASHBOARD
from dashboards.nodes import FLEET_DASHBOARD, NODE_DASHBOARD
from dashboards.render import dashboard_json
from dashboards.spec import Dashboard
from dashboards.training_run import TRAINING_DASHBOARD

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "dashboards"
RULES_DIR = DASHBOARD_DIR / "rules"
DOCS = ROOT / "docs" / "dashboards.md"

DASHBOARDS: tuple[Dashboard, ...] = (FLEET_DASHBOARD, NODE_DASHBOARD, TRAINING_DASHBOARD, INFERENCE_DASHBOARD)


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
    optional = sorted((RULES_DIR / "optional").glob("*.yaml"))
    for path in [*sorted(RULES_DIR.glob("*.yaml")), *optional]:
        text = path.read_text(encoding="utf-8")
        comments = rule_comments(text)
        where = "dashboards/rules/" + path.relative_to(RULES_DIR).as_posix()
        for group in yaml.safe_load(text)["groups"]:
            note = " (optional: load it by choice)" if path in optional else ""
            out.append(f"### Group `{group['name']}` (`{where}`){note}\n")
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
    parser.add_argument("--provisioning", type=Path, metavar="DIR",
                        help="only write the dashboards for Grafana file provisioning into DIR (the data source "
                             "variable defaults to Grafana's default data source; there is no import step)")
    args = parser.parse_args(argv)
    if args.provisioning:
        args.provisioning.mkdir(parents=True, exist_ok=True)
        for d in DASHBOARDS:
            (args.provisioning / f"{d.name}.json").write_text(dashboard_json(d, provisioned=True), encoding="utf-8")
            print(f"wrote: {args.provisioning / f'{d.name}.json'}")
        return 0
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

