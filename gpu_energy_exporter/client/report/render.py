"""The documents of ``gpu-energy-exporter report``: the report as blocks (headings, tables, images,
notes), rendered to Markdown and to a self-contained HTML page (plots embedded as base64 PNG).

This module formats the ledger's figures and computes none of its own (only the ratios between compared
runs); it never plots and never fetches, and reads only the PNG files it embeds.
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpu_energy_exporter import __version__
from gpu_energy_exporter.client.fmt import (
    GIB,
    fmt_co2,
    fmt_duration,
    fmt_mfu,
    is_provisional,
    provisional,
    rank_coverage,
)
from gpu_energy_exporter.client.report.plots import COMPARISON_PLOTS, PLOTS
from gpu_energy_exporter.client.report.run import RunData, num
from gpu_energy_exporter.client.report.serving import is_serving_run, serving_blocks, serving_rows
from gpu_energy_exporter.core.textfmt import fmt_num, md_text, printable


def fmt_energy(joules: float | None) -> str:
    """J below 1 kJ, kJ below 0.1 kWh, then kWh: a report's figures span from J per 10k tokens to a run."""
    if joules is None or not math.isfinite(joules):
        return "-"
    if abs(joules) < 1000:
        return f"{joules:.0f} J"
    if abs(joules) < 360_000:
        return f"{joules / 1000:.1f} kJ"
    return f"{joules / 3.6e6:.3f} kWh"


Block = tuple[Any, ...]


def _kwh(j: float | None) -> str:
    if j is None:
        return "-"
    return f"{j / 3.6e6:.4g} kWh ({j:,.0f} J)"


def _w(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f} W"


def _bytes(v: float | None) -> str:
    return "-" if v is None else f"{v / GIB:.1f} GiB"


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """The final energy summary, formatted from the ledger's figures."""
    s = run.summary
    n = {k: num(s.get(k)) for k in s}
    warm = n.get("warmup_s")
    if "warmup_s" in s and s["warmup_s"] is None:
        window = " (after the exporter's --runs.warmup)"
    else:
        window = f" (after a {warm:g} s warm-up)" if warm else " (whole run)"
    intensity, pue = n.get("carbon_intensity_g_per_kwh"), n.get("pue")
    co2 = fmt_co2(n.get("co2_g"))
    if n.get("co2_g") is not None and intensity is not None:
        co2 += f" ({intensity:.0f} gCO2e/kWh x PUE {pue if pue is not None else 1.0:.2f})"
    rows = [
        ("total energy", _kwh(n.get("energy_j"))),
        ("average power", _w(n.get("avg_power_w"))),
        ("peak power", _w(n.get("peak_power_w"))),
        ("J/token" + window, fmt_num(n.get("j_per_token"))),
        ("energy per 10k tokens", fmt_energy(n.get("energy_per_10k_tokens_j"))),
        ("CO2", co2),
        ("tokens", f"{n['tokens']:,.0f}" if n.get("tokens") is not None else "-"),
        ("tokens/s" + window, fmt_num(n.get("tokens_per_s"))),
        ("MFU" + window, fmt_mfu(n.get("mfu"))),
        ("duration", fmt_duration(n.get("duration_s"))),
        ("steps", (f"{n['steps']:,.0f}" if n.get("steps") is not None else "-")
         + (f" of {n['total_steps']:,.0f} planned" if n.get("total_steps") else "")),
    ]
    if is_provisional(s):
        # A run still going: part of its energy is the power readings' estimate since the last counter read.
        rows = [(label, provisional(value, s) if label.startswith(_ENERGY_ROWS) else value) for label, value in rows]
        rows.insert(0, ("settlement", f"~{fmt_energy(n.get('energy_provisional_j'))} of the energy is provisional: "
                                      "the power readings' estimate since the GPUs' last energy-counter read, "
                                      "settled at the next read (figures marked ~)"))
    coverage = rank_coverage(s)
    if coverage is not None:
        # A multi-node run read from one exporter: say so before any figure is taken as the run's.
        rows.insert(0, ("coverage", f"{coverage}: tokens, energy, CO2 and J/token cover those ranks and "
                                    "their GPUs only (the whole run: report --prometheus URL)"))
    if n.get("idle_energy_j") is not None or n.get("dynamic_energy_j") is not None:
        rows.append(("idle / dynamic energy", f"{fmt_energy(n.get('idle_energy_j'))} / "
                                              f"{fmt_energy(n.get('dynamic_energy_j'))}"))
    if n.get("vram_peak_bytes") is not None:
        rows.append(("VRAM peak / average", f"{_bytes(n.get('vram_peak_bytes'))} / {_bytes(n.get('vram_avg_bytes'))}"))
    if n.get("best_loss") is not None:
        at = f" at step {n['best_loss_step']:,.0f}" if n.get("best_loss_step") is not None else ""
        rows.append(("best loss", f"{n['best_loss']:.4f}{at} (last {fmt_num(n.get('last_loss'))})"))
    if n.get("mean_step_s") is not None:
        rows.append(("mean step time", f"{n['mean_step_s']:.3f} s"))
    return serving_rows(run, rows) if is_serving_run(run) else rows


#: The summary rows that carry energy (marked ~ while part of it is provisional), by the start of their label.
_ENERGY_ROWS = ("total energy", "average power", "J/token", "energy per 10k tokens", "CO2")

_META = ("status", "model", "backend", "optimizer", "precision", "batch_size", "grad_accum", "seq_len", "seed",
         "world_size", "ranks", "gpu_count", "gpu_models", "gpu_uuids", "start_time", "end_time", "notes")


def metadata_rows(run: RunData) -> list[tuple[str, str]]:
    rows = []
    for key in _META:
        value = run.summary.get(key)
        if value not in (None, ""):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            rows.append((key, str(value)))
    return rows


_COMPARE: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("backend", "backend", lambda v: str(v) if v else "-"),
    ("model", "model", lambda v: str(v) if v else "-"),
    ("energy_j", "total energy", lambda v: _kwh(num(v))),
    ("avg_power_w", "average power", lambda v: _w(num(v))),
    ("peak_power_w", "peak power", lambda v: _w(num(v))),
    ("j_per_token", "J/token", lambda v: fmt_num(num(v))),
    ("energy_per_10k_tokens_j", "energy per 10k tokens", lambda v: fmt_energy(num(v))),
    ("tokens_per_s", "tokens/s", lambda v: fmt_num(num(v))),
    ("mfu", "MFU", lambda v: fmt_mfu(num(v))),
    ("co2_g", "CO2", lambda v: fmt_co2(num(v))),
    ("vram_peak_bytes", "VRAM peak", lambda v: _bytes(num(v))),
    ("duration_s", "duration", lambda v: fmt_duration(num(v))),
    ("best_loss", "best loss", lambda v: fmt_num(num(v))),
)


def build_blocks(runs: Sequence[RunData], plots: dict[str, dict[str, str]], out_dir: str) -> list[Block]:
    blocks: list[Block] = []
    if len(runs) == 1:
        title = ("Serving session report: " if is_serving_run(runs[0]) else "Training run report: ") + runs[0].run_id
    else:
        title = f"Runs compared ({len(runs)})" if any(is_serving_run(r) for r in runs) else \
            f"Training runs compared ({len(runs)})"
    blocks.append(("h1", title))
    if any(r.simulated for r in runs):
        blocks.append(("warn", "SIMULATED DATA: these runs were produced by `gpu-energy-exporter demo` on simulated "
                               "GPUs. The figures show how the report works; they are not measurements."))
    sources = sorted({r.source for r in runs})
    blocks.append(("p", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by gpu-energy-exporter {__version__} "
                        f"from {', '.join(sources)}. Energy comes from the GPUs' energy counters (never integrated "
                        "from power); how each figure is computed: docs/ledger.md."))
    if len(runs) > 1:
        blocks.append(("h2", "Comparison"))
        headers = ["", *(r.run_id for r in runs)]
        rows = [[label, *(fmt(r.summary.get(key)) for r in runs)] for key, label, fmt in _COMPARE]
        blocks.append(("table", headers, rows))
        base = runs[0]
        for r in runs[1:]:
            ratio = []
            for key, label in (("j_per_token", "J/token"), ("tokens_per_s", "tokens/s"), ("energy_j", "energy")):
                a, b = num(r.summary.get(key)), num(base.summary.get(key))
                if a is not None and b:
                    ratio.append(f"{label} {a / b:.2f}x")
            if ratio:
                blocks.append(("p", f"{r.label} against {base.label}: " + ", ".join(ratio) + "."))
        for name, caption in COMPARISON_PLOTS:
            if name in plots.get("", {}):
                blocks.append(("img", caption, plots[""][name]))
    for r in runs:
        blocks.append(("h2", "Energy summary" if len(runs) == 1 else
                       f"{'Serving session' if is_serving_run(r) else 'Run'} {r.label}"))
        blocks.append(("table", ["figure", "value"], [list(row) for row in summary_rows(r)]))
        blocks += serving_blocks(r)
        blocks.append(("h3", "Run"))
        blocks.append(("table", ["", ""], [list(row) for row in metadata_rows(r)]))
        blocks.append(("h3", "Plots"))
        for name, caption in PLOTS:
            if name in plots.get(r.run_id, {}):
                blocks.append(("img", caption, plots[r.run_id][name]))
        notes = [n for n in str(r.summary.get("ledger_notes") or "").split("; ") if n] + r.notes
        if notes:
            blocks.append(("h3", "Notes"))
            blocks.append(("ul", notes))
    return blocks


def _md_cell(text: str) -> str:
    return md_text(str(text), block=False)


def render_markdown(blocks: Sequence[Block], out_dir: str) -> str:
    lines: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + md_text(b[1]), ""]
        elif kind == "p":
            lines += [md_text(b[1], code_spans=True), ""]
        elif kind == "warn":
            lines += [f"> **{md_text(b[1], code_spans=True)}**", ""]
        elif kind == "table":
            headers, rows = b[1], b[2]
            lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
            lines.append("|" + "---|" * len(headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            lines.append("")
        elif kind == "img":
            rel = os.path.relpath(b[2], out_dir).replace(os.sep, "/")
            lines += [f"![{md_text(b[1])}]({rel.replace(' ', '%20').replace(')', '%29')})", ""]
        elif kind == "ul":
            lines += [f"- {md_text(str(item))}" for item in b[1]] + [""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1080px;margin:2em auto;
padding:0 1em;color:#222}table{border-collapse:collapse;margin:0.5em 0 1.2em}td,th{border:1px solid #ccc;
padding:4px 10px;text-align:left;font-variant-numeric:tabular-nums}th{background:#f2f2f2}
.warn{background:#fff3cd;border:1px solid #e0b000;padding:0.6em 1em;font-weight:bold}
img{max-width:100%;border:1px solid #ddd;margin:0.3em 0 1.2em}figcaption{color:#555;font-size:0.9em}"""


def render_html(blocks: Sequence[Block]) -> str:
    """A self-contained page: the plots are embedded as base64 PNG data URLs."""
    def esc(text: str) -> str:
        return html.escape(printable(text))  # run ids, labels and notes came over OTLP
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{esc(blocks[0][1]) if blocks else 'report'}</title>", f"<style>{_CSS}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{esc(b[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "warn":
            parts.append(f'<p class="warn">{_inline(b[1])}</p>')
        elif kind == "table":
            headers, rows = b[1], b[2]
            head = "" if not any(headers) else "<tr>" + "".join(f"<th>{esc(str(h))}</th>" for h in headers) + "</tr>"
            body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
            parts.append(f"<table>{head}{body}</table>")
        elif kind == "img":
            with open(b[2], "rb") as f:
                data = base64.b64encode(f.read()).decode("ascii")
            parts.append(f'<figure><img alt="{esc(b[1])}" src="data:image/png;base64,{data}">'
                         f"<figcaption>{esc(b[1])}</figcaption></figure>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{esc(str(i))}</li>" for i in b[1]) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(printable(text)))
