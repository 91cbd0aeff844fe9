"""``gpu-energy-exporter runs``: list and compare training runs from the run ledger.

Reads the CSV the exporter appends to with ``--runs.csv`` (``--csv FILE`` or the same environment variable
as the exporter flag, ``GPU_ENERGY_EXPORTER_RUNS_CSV``; a line that is not a row is reported and skipped), or
its database (``--db FILE``, read-only: ``core.runs_db``), or the active and recent runs of a running
exporter (``--url http://host:9863``, its ``/api/v1/runs``; without a CSV the default:
``$GPU_ENERGY_EXPORTER_URL``, else ``http://localhost:9863``; the same client options as ``top`` and
``report``), or whole runs from a Prometheus server that scraped the exporters (``--prometheus URL``: a
multi-node run summed over its nodes, as ``report --prometheus`` reads a run). A run one exporter sees only
part of (fewer ranks than its ``world_size``) is marked "(2 of 4 ranks on this node)". Prints an aligned
table, JSON or CSV; with
``--group-by COLUMN`` it compares groups (mean J/token, tokens/s, VRAM peak, and each group's ratio to a
baseline group), e.g. ``--group-by backend`` for bitsandbytes against Unsloth.

This module only reads: it never writes the ledger and never contacts anything but the given URL (or the
given Prometheus). Whatever it prints goes through ``client.safeout``: no control character reaches the
terminal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from gpu_energy_exporter.client.api import (
    DEFAULT_URL,
    NOT_RUNNING,
    RUNS_PATH,
    URL_ENV,
    ExporterClient,
    ExporterUnreachable,
    add_client_flags,
    client_from_args,
)
from gpu_energy_exporter.client.fmt import (
    PROVISIONAL_NOTE,
    SERVING_MARK,
    fmt_gib,
    fmt_mfu,
    is_provisional,
    is_serving,
    provisional,
    rank_coverage,
)
from gpu_energy_exporter.client.ledgerfiles import MAX_REPORTED, RunsError, load_csv, load_db
from gpu_energy_exporter.client.report.prometheus import PrometheusSource, whole_runs
from gpu_energy_exporter.client.report.run import ReportError
from gpu_energy_exporter.client.safeout import printable_stream
from gpu_energy_exporter.core.flagparser import FlagParser
from gpu_energy_exporter.core.flagtypes import env_of, parse_duration
from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.core.textfmt import csv_cell, csv_record, fmt_num, strict_json

#: The exporter's --runs.csv environment variable: the same file for the exporter and this command.
CSV_ENV = env_of("runs.csv")
#: The exporter's --runs.db environment variable.
DB_ENV = env_of("runs.db")

# ----------------------------------------------------------------------------------------------------
# loading


def load_url(client: ExporterClient) -> list[dict[str, Any]]:
    """Active and recent runs from a running exporter (``GET <url>/api/v1/runs``); ExporterUnreachable
    (with its cause) when it cannot be read."""
    doc = client.get(RUNS_PATH)
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, list):
        raise RunsError(f"{client.base_url}{RUNS_PATH} did not answer with the run ledger's JSON: is "
                        f"{client.base_url} a gpu-energy-exporter (check --url)?")
    return [{k: r.get(k) for k in COLUMN_NAMES} for r in runs if isinstance(r, dict)]


def load_prometheus(args: argparse.Namespace, env: Mapping[str, str]) -> list[dict[str, Any]]:
    """Whole runs from the Prometheus at ``args.prometheus`` (``report.prometheus.whole_runs``)."""
    args.url = args.prometheus
    try:
        since = parse_duration(args.since)
    except ValueError as exc:
        raise RunsError(f"--since {args.since!r} {exc}") from None
    try:
        return whole_runs(PrometheusSource(client_from_args(args, dict(env)), since=since))
    except (ReportError, ExporterUnreachable) as exc:
        raise RunsError(str(exc).replace("the exporter", "Prometheus")) from None


# ----------------------------------------------------------------------------------------------------
# formatting


def _int(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _watts(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _duration(value: float | None) -> str:
    if value is None:
        return "-"
    total = int(round(value))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def _start(value: str | None) -> str:
    if not value:
        return "-"
    return value[:16].replace("T", " ")


def _text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


@dataclass(frozen=True)
class _Col:
    header: str
    key: str
    fmt: Callable[[Any], str]
    right: bool = True


TABLE: tuple[_Col, ...] = (
    _Col("run id", "run_id", _text, right=False),
    _Col("start (UTC)", "start_time", _start, right=False),
    _Col("duration", "duration_s", _duration),
    _Col("model", "model", _text, right=False),
    _Col("backend", "backend", _text, right=False),
    _Col("tokens", "tokens", _int),
    _Col("tok/s", "tokens_per_s", fmt_num),
    _Col("J/token", "j_per_token", fmt_num),
    _Col("MFU", "mfu", fmt_mfu),
    _Col("kWh", "energy_kwh", fmt_num),
    _Col("avg W", "avg_power_w", _watts),
    _Col("peak W", "peak_power_w", _watts),
    _Col("VRAM peak GiB", "vram_peak_bytes", fmt_gib),
    _Col("gCO2", "co2_g", fmt_num),
    _Col("status", "status", _text, right=False),
)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)]) + "\n"


SIMULATED_MARK = " (SIMULATED)"


def is_simulated(run: dict[str, Any]) -> bool:
    """A run of ``gpu-energy-exporter demo``: its GPUs are the demo's simulated ones (``devices/simulated.py``
    names them "... (simulated)", UUIDs GPU-SIM...)."""
    return "(simulated)" in str(run.get("gpu_models") or "") or str(run.get("gpu_uuids") or "").startswith("GPU-SIM")


def runs_table(runs: Sequence[dict[str, Any]]) -> str:
    rows = [[c.fmt(r.get(c.key)) for c in TABLE] for r in runs]
    # The first column stays the bare run id, so that it can be copied into `report RUN_ID`; marks go on
    # the status.
    status = next(i for i, c in enumerate(TABLE) if c.key == "status")
    partial = []
    energy_cols = [i for i, c in enumerate(TABLE) if c.key in ("j_per_token", "energy_kwh", "avg_power_w", "co2_g")]
    for row, r in zip(rows, runs, strict=True):
        for i in energy_cols:
            row[i] = provisional(row[i], r)
        if is_serving(r):
            row[status] += SERVING_MARK
        if is_simulated(r):
            row[status] += SIMULATED_MARK
        coverage = rank_coverage(r)
        if coverage is not None:
            # A multi-node run seen from one node: its figures are that node's share, not the run's.
            row[status] += f" ({coverage})"
            partial.append(r)
    text = render_table([c.header for c in TABLE], rows, [c.right for c in TABLE])
    if any(is_provisional(r) for r in runs):
        text += PROVISIONAL_NOTE + "\n"
    if any(is_serving(r) for r in runs):
        text += ("(serving): a local inference server's session (--collector.inference): tokens are its output "
                 "tokens, J/token is J per output token\n")
    if any(is_simulated(r) for r in runs):
        text += "(SIMULATED): a run of `gpu-energy-exporter demo` on simulated GPUs, not a measurement\n"
    if any(r.get("ranks_scope") != "in Prometheus" for r in partial):
        text += ("(... on this node / from this node's GPUs): this exporter's ledger saw part of the run (fewer "
                 "ranks than its world size, or ranks running on other nodes' GPUs); its tokens, energy, CO2 and "
                 "J/token cover this node's ranks and GPUs only. The whole run: runs --prometheus URL\n")
    if any(r.get("ranks_scope") == "in Prometheus" for r in partial):
        text += ("(N of M ranks in Prometheus): only N of the run's M ranks pushed to an exporter that Prometheus "
                 "scrapes; the figures cover those ranks\n")
    return text


# ----------------------------------------------------------------------------------------------------
# comparison


def _mean(values: Sequence[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(nums) / len(nums) if nums else None


NONE_GROUP = "(none)"


def compare(runs: Sequence[dict[str, Any]], by: str, baseline: str | None = None) -> dict[str, Any]:
    """Per-group means and every other group's ratio to the baseline (default: the first group by
    name). Means are over the runs that have the figure."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        value = r.get(by)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        groups.setdefault(NONE_GROUP if value in (None, "") else str(value), []).append(r)
    stats: list[dict[str, Any]] = []
    for name in sorted(groups):
        members = groups[name]
        stats.append({
            "group": name,
            "runs": len(members),
            "mean_j_per_token": _mean([m.get("j_per_token") for m in members]),
            "mean_tokens_per_s": _mean([m.get("tokens_per_s") for m in members]),
            "mean_vram_peak_bytes": _mean([m.get("vram_peak_bytes") for m in members]),
            "mean_energy_kwh": _mean([m.get("energy_kwh") for m in members]),
            "mean_co2_g": _mean([m.get("co2_g") for m in members]),
        })
    if baseline is None:
        baseline = stats[0]["group"] if stats else None
    elif baseline not in groups:
        raise RunsError(f"--baseline {baseline!r} is not a value of {by!r}; groups: {', '.join(sorted(groups))}")
    base = next((s for s in stats if s["group"] == baseline), None)
    comparisons = []
    for s in stats:
        if base is None or s is base:
            continue
        comparisons.append({
            "group": s["group"],
            "baseline": baseline,
            **{f"{k[len('mean_'):]}_ratio": _ratio(s[k], base[k])
               for k in ("mean_j_per_token", "mean_tokens_per_s", "mean_vram_peak_bytes")},
        })
    return {"group_by": by, "baseline": baseline, "groups": stats, "comparisons": comparisons}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def comparison_text(result: dict[str, Any]) -> str:
    by = result["group_by"]
    headers = [by, "runs", "mean J/token", "mean tok/s", "mean VRAM peak GiB", "mean kWh", "mean gCO2"]
    rows = [[s["group"], str(s["runs"]), fmt_num(s["mean_j_per_token"]), fmt_num(s["mean_tokens_per_s"]),
             fmt_gib(s["mean_vram_peak_bytes"]), fmt_num(s["mean_energy_kwh"]), fmt_num(s["mean_co2_g"])]
            for s in result["groups"]]
    text = render_table(headers, rows, [False, True, True, True, True, True, True])
    lines = [f"{c['group']} vs {c['baseline']}: J/token {_x(c['j_per_token_ratio'])}, "
             f"tokens/s {_x(c['tokens_per_s_ratio'])}, VRAM peak {_x(c['vram_peak_bytes_ratio'])}"
             for c in result["comparisons"]]
    if lines:
        text += "\n" + "\n".join(lines) + "\n"
    return text


# ----------------------------------------------------------------------------------------------------
# command line


def new_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="gpu-energy-exporter runs",
        description="List and compare training runs recorded by the exporter's run ledger.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""examples:
  gpu-energy-exporter runs --csv runs.csv
  gpu-energy-exporter runs --csv runs.csv --group-by backend          compare backends (J/token, tok/s, VRAM)
  gpu-energy-exporter runs --csv runs.csv --group-by backend --baseline bnb
  gpu-energy-exporter runs --db .runs-state/runs.db --group-by backend   the database, read directly
  gpu-energy-exporter runs --url http://localhost:9863                active and recent runs, live
  gpu-energy-exporter runs --prometheus http://prometheus:9090        whole runs, every node summed
  {CSV_ENV}=runs.csv gpu-energy-exporter runs --format json
columns of the CSV and how each figure is computed, the database's schema and queries: docs/ledger.md
""")
    parser.add_argument("--csv", metavar="FILE", default=None,
                        help=f"the exporter's --runs.csv file [env {CSV_ENV}]")
    parser.add_argument("--db", metavar="FILE", default=None,
                        help=f"the exporter's database (runs.db in its --runs.state-dir, or --runs.db), read-only: "
                             f"every finished run and the open ones [env {DB_ENV}]")
    add_client_flags(parser, url_help=(
        f"read the active and recent runs of a running exporter (its /api/v1/runs). This is the default when "
        f"neither --csv nor {CSV_ENV} is given: then ${URL_ENV}, else {DEFAULT_URL}"))
    parser.add_argument("--prometheus", metavar="URL", default=None,
                        help="read whole runs from this Prometheus server (the run ledgers' series of every "
                             "exporter it scrapes, summed over nodes); the client options apply to it")
    parser.add_argument("--since", metavar="DURATION", default="7d",
                        help="with --prometheus: how far back to look for runs (default: 7d)")
    parser.add_argument("--group-by", metavar="COLUMN", default=None,
                        help="compare groups of runs by this column (backend, model, precision, optimizer, ...)")
    parser.add_argument("--baseline", metavar="GROUP", default=None,
                        help="group the others are compared to (default: the first by name)")
    parser.add_argument("--status", metavar="STATUS[,STATUS]", default=None,
                        help="only runs with these statuses (finished, stale, exporter_stopped, running)")
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table", help="output format")
    return parser


def main(argv: list[str], *, stdout: IO[str] | None = None, stderr: IO[str] | None = None,
         environ: dict[str, str] | None = None) -> int:
    # Run ids, labels, notes and error messages come from clients and servers: no control character of
    # theirs reaches the terminal, whatever the format (client.safeout).
    out = printable_stream(stdout if stdout is not None else sys.stdout)
    err = printable_stream(stderr if stderr is not None else sys.stderr)
    env = os.environ if environ is None else environ
    parser = new_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    bad: list[str] = []
    try:
        if sum(bool(x) for x in (args.url, args.csv, args.prometheus, args.db)) > 1:
            raise RunsError("give one of --csv, --db, --url and --prometheus")
        chosen = args.url or args.prometheus or args.csv or args.db
        path = None if chosen else env.get(CSV_ENV)
        db = args.db or (None if chosen or path else env.get(DB_ENV))
        if args.prometheus:
            runs, source = load_prometheus(args, env), args.prometheus
        elif args.csv or path:
            csv_path = str(args.csv or path)
            runs, source = load_csv(csv_path, bad), csv_path
        elif db:
            runs, source = load_db(db), db
        else:
            try:
                client = client_from_args(args, env)
                runs, source = load_url(client), client.base_url
            except (ExporterUnreachable, RunsError) as exc:
                if args.url or env.get(URL_ENV) or getattr(exc, "cause", None) != NOT_RUNNING:
                    raise RunsError(str(exc)) from None
                # Neither a CSV nor a URL was asked for: say both ways.
                raise RunsError(f"no CSV given and {exc}; or read a runs CSV: pass --csv FILE (the exporter's "
                                f"--runs.csv) or set {CSV_ENV}; or its database: --db FILE") from None
        total = len(runs)
        if args.status:
            wanted = {s.strip() for s in args.status.split(",") if s.strip()}
            runs = [r for r in runs if r.get("status") in wanted]
        if args.group_by and args.group_by not in COLUMN_NAMES:
            raise RunsError(f"--group-by {args.group_by!r} is not a ledger column; try backend, model, precision, "
                            "optimizer, batch_size, seq_len or gpu_models")
        result = compare(runs, args.group_by, args.baseline) if args.group_by else None
    except RunsError as exc:
        print(f"gpu-energy-exporter runs: error: {exc}", file=err)
        return 2
    for line in bad[:MAX_REPORTED]:
        print(f"gpu-energy-exporter runs: {source}: {line}: skipped (not a row of the run ledger)", file=err)
    if len(bad) > MAX_REPORTED:
        print(f"gpu-energy-exporter runs: {source}: {len(bad) - MAX_REPORTED} more line(s) skipped", file=err)
    if args.format == "json":
        doc: Any = {"runs": runs, **({"comparison": result} if result else {})}
        out.write(strict_json(doc, indent=2) + "\n")
    elif args.format == "csv":
        _write_csv(out, runs, result)
    elif not runs and total:
        out.write(f"none of the {total} runs in {source} has status {args.status}\n")
    elif not runs:
        out.write(f"no runs in {source} yet\n")
    else:
        out.write(runs_table(runs))
        if result is not None:
            out.write(f"\nby {result['group_by']} (mean over runs):\n")
            out.write(comparison_text(result))
    return 0


def _write_csv(out: IO[str], runs: Sequence[dict[str, Any]], result: dict[str, Any] | None) -> None:
    """CSV on ``out``, quoted as RFC 4180 requires (``csv_record``), text cells neutralised for spreadsheets."""
    if result is not None:
        keys = ["group", "runs", "mean_j_per_token", "mean_tokens_per_s", "mean_vram_peak_bytes",
                "mean_energy_kwh", "mean_co2_g"]
        out.write(csv_record([result["group_by"] if k == "group" else k for k in keys]))
        for s in result["groups"]:
            out.write(csv_record([_cell(s[k]) for k in keys]))
        return
    out.write(csv_record(COLUMN_NAMES))
    for r in runs:
        out.write(csv_record([_cell(r.get(k)) for k in COLUMN_NAMES]))


def _cell(value: Any) -> Any:
    """A CSV cell: empty for None, whole floats as integers, text neutralised for spreadsheets."""
    if value is None:
        return ""
    value = _plain(value)
    return csv_cell(value) if isinstance(value, str) else value


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)
    return value
