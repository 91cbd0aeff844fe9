"""The command line of ``gpu-energy-exporter report``: flags, reading each RUN from the source it names,
and writing the report directory (plots, ``report.md``, ``report.html``, ``report.json``).

This module wires sources, plots and rendering together; it computes no figure and draws nothing itself,
and writes only under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from gpu_energy_exporter import __version__
from gpu_energy_exporter.client.api import ExporterClient, ExporterUnreachable, add_client_flags, client_from_args
from gpu_energy_exporter.client.fmt import fmt_co2, rank_coverage
from gpu_energy_exporter.client.report.plots import load_pyplot, plot_comparison, plot_run
from gpu_energy_exporter.client.report.prometheus import PrometheusSource
from gpu_energy_exporter.client.report.render import build_blocks, fmt_energy, render_html, render_markdown
from gpu_energy_exporter.client.report.run import ReportError, RunData, num
from gpu_energy_exporter.client.report.sources import load_file, load_from_exporter
from gpu_energy_exporter.client.safeout import printable_stream
from gpu_energy_exporter.core.flagparser import FlagParser
from gpu_energy_exporter.core.flagtypes import parse_duration
from gpu_energy_exporter.core.textfmt import fmt_num, json_safe, printable


def _plain_text(run: RunData) -> RunData:
    """``run`` with no control character in its run id, summary text, GPU names and notes: they came over
    OTLP, and would reach the terminal (the summary line, a plotting library's warning about a glyph) and
    the report's files."""
    def clean(value: Any) -> Any:
        return printable(value, keep_newlines=False) if isinstance(value, str) else value

    run.run_id = clean(run.run_id)
    run.summary = {k: clean(v) for k, v in run.summary.items()}
    run.gpus = [{k: clean(v) for k, v in g.items()} for g in run.gpus]
    run.notes = [clean(n) for n in run.notes]
    return run


def looks_like_path(item: str) -> bool:
    """A RUN that names a file rather than a run id: ``*.json``, an absolute, ``./``, ``../`` or ``~`` path,
    or a path whose directory exists (``runs/x`` beside a ``runs/``). Run ids may hold any character (they
    come over OTLP), so a bare word or a slash into nothing stays a run id."""
    if item.lower().endswith(".json") or item.startswith(("/", "./", "../", "~")):
        return True
    head = os.path.dirname(item)
    return bool(head) and os.path.isdir(head)


def safe_name(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._")[:100] or "run"


def write_report(runs: Sequence[RunData], out_dir: str, progress: Callable[[str], None] = lambda _m: None
                 ) -> dict[str, str]:
    """Plots, report.md, report.html and report.json under ``out_dir``; returns their paths."""
    plt = load_pyplot()
    os.makedirs(out_dir, exist_ok=True)
    plots: dict[str, dict[str, str]] = {}
    dirs: dict[str, str] = {}
    for i, r in enumerate(runs, 1):
        progress(f"plotting {r.run_id} ({i}/{len(runs)})")
        name = safe_name(r.run_id)
        while name in dirs.values():
            name += "_"
        dirs[r.run_id] = name
        plots[r.run_id] = plot_run(r, os.path.join(out_dir, name), plt)
    if len(runs) > 1:
        progress("plotting the comparison")
        plots[""] = plot_comparison(runs, out_dir, plt)
    blocks = build_blocks(runs, plots, out_dir)
    paths = {"markdown": os.path.join(out_dir, "report.md"), "html": os.path.join(out_dir, "report.html"),
             "json": os.path.join(out_dir, "report.json")}
    progress("writing report.md, report.html, report.json")
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(render_markdown(blocks, out_dir))
    with open(paths["html"], "w", encoding="utf-8") as f:
        f.write(render_html(blocks))
    doc: dict[str, Any] = {"generator": f"gpu-energy-exporter {__version__}",
                           "runs": [{"run_id": r.run_id, "source": r.source, "simulated": r.simulated,
                                     "summary": r.summary, "notes": r.notes,
                                     "plots": {k: os.path.relpath(v, out_dir) for k, v in plots[r.run_id].items()}}
                                    for r in runs]}
    if "" in plots:
        doc["comparison_plots"] = {k: os.path.relpath(v, out_dir) for k, v in plots[""].items()}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=2, allow_nan=False)
        f.write("\n")
    for r in runs:
        for name, path in plots[r.run_id].items():
            paths[f"{r.run_id}:{name}"] = path
    return paths


def new_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="gpu-energy-exporter report",
        description="Per-run report (Markdown + self-contained HTML) with PNG plots of power, energy per step, "
                    "loss against energy, memory and throughput, and the final energy summary. Several runs "
                    "give a comparison report.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""RUN is a run id (read from --url or --prometheus) or the path of a JSON summary the run ledger
wrote (runs/<run id>.json beside the exporter's --runs.csv).
examples:
  gpu-energy-exporter report demo-20250101-120000-unsloth                  from the exporter on this machine
  gpu-energy-exporter report RUN_A RUN_B --out bnb-vs-unsloth               comparison report
  gpu-energy-exporter report ~/gpu-runs/runs/my-run.json                   from the ledger's JSON summary
  gpu-energy-exporter report my-run --prometheus http://prometheus:9090 --since 30d
""")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run id(s) or ledger JSON summary file(s)")
    add_client_flags(parser)
    parser.add_argument("--prometheus", default=None, metavar="URL",
                        help="read the runs from this Prometheus server instead of the exporter "
                             "(--user/--password-file/--ca-file/--insecure apply to it)")
    parser.add_argument("--since", default="7d", metavar="DURATION",
                        help="with --prometheus: how far back to look for the runs (default: 7d)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output directory (default: report-<run id> or report-comparison-<time> in the "
                             "current directory; the command prints where it wrote)")
    return parser


def main(argv: list[str], *, stderr: IO[str] | None = None, stdout: IO[str] | None = None) -> int:
    # progress lines, errors and the summary carry run ids, file names and server messages: no control
    # character of theirs reaches the terminal (client.safeout)
    err = printable_stream(stderr if stderr is not None else sys.stderr)
    out = printable_stream(stdout if stdout is not None else sys.stdout)
    try:
        args = new_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)

    def progress(message: str) -> None:
        print(f"report: {message}", file=err, flush=True)

    try:
        since = parse_duration(args.since)
    except ValueError as exc:
        print(f"gpu-energy-exporter report: error: --since {args.since!r} {exc}", file=err)
        return 2
    try:
        if args.prometheus and args.url:
            raise ReportError("give either --url (the exporter) or --prometheus, not both")
        load_pyplot()  # fail before any network work when the extra is missing
        runs: list[RunData] = []
        client: ExporterClient | None = None
        for i, item in enumerate(args.runs, 1):
            if looks_like_path(item):
                # a path that does not exist is a missing file, not an unknown run id
                path = os.path.expanduser(item)
                progress(f"reading {path} ({i}/{len(args.runs)})")
                runs.append(load_file(path))
                continue
            if client is None:
                if args.prometheus:
                    args.url = args.prometheus
                client = client_from_args(args, timeout=30.0)
            if args.prometheus:
                runs.append(PrometheusSource(client, since=since, progress=progress).load(item))
            else:
                progress(f"fetching run {item} from {client.base_url} ({i}/{len(args.runs)})")
                runs.append(load_from_exporter(client, item))
        runs = [_plain_text(r) for r in runs]
        out_dir = args.out or ("report-" + safe_name(runs[0].run_id) if len(runs) == 1
                               else time.strftime("report-comparison-%Y%m%d-%H%M%S"))
        # Said before the plots are drawn, as an absolute path: the default is the current directory,
        # which is not always where the user thinks they are.
        out_dir = os.path.abspath(out_dir)
        where = "" if args.out else " (the current directory; --out DIR to choose)"
        progress(f"writing into {out_dir}{os.sep}{where}")
        paths = write_report(runs, out_dir, progress)
    except (ReportError, ExporterUnreachable) as exc:
        print(f"gpu-energy-exporter report: error: {exc}", file=err)
        return 2
    out.write(f"wrote {paths['markdown']}\n      {paths['html']} (self-contained)\n      {paths['json']}\n")
    for r in runs:
        s = r.summary
        out.write(f"{r.run_id}: {fmt_energy(num(s.get('energy_j')))}, {fmt_num(num(s.get('j_per_token')))} J/token, "
                  f"{fmt_num(num(s.get('tokens_per_s')))} tokens/s, CO2 {fmt_co2(num(s.get('co2_g')))}"
                  + ("  [SIMULATED DATA]" if r.simulated else "")
                  + (f"  [{coverage}]" if (coverage := rank_coverage(s)) else "") + "\n")
    return 0
