"""What ``report`` adds for a serving session (a local inference server's run, ``--collector.inference``): its
summary figures named for what they are (J per output token, prompt tokens, requests, J per 1,000 prompt and
output tokens) and its per-model and per-hour tables, from the run document's ``serving`` object
(docs/ledger.md). Formats the ledger's figures and computes none; never fetches, never plots.
"""

from __future__ import annotations

from typing import Any

from gpu_energy_exporter.client.fmt import SERVING_NOTE, fmt_co2, is_serving
from gpu_energy_exporter.client.report.run import RunData, num
from gpu_energy_exporter.core.textfmt import fmt_num

__all__ = ["is_serving_run", "serving_blocks", "serving_rows"]


def is_serving_run(run: RunData) -> bool:
    return is_serving(run.summary)


def _count(value: Any) -> str:
    n = num(value)
    return f"{n:,.0f}" if n is not None else "-"


def _energy(value: Any) -> str:
    n = num(value)
    return f"{n / 3.6e6:.4g} kWh" if n is not None else "-"


def serving_rows(run: RunData, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The summary rows of a serving session: J/token is J per output token, tokens are output tokens, and
    the server's own counts follow; the training rows a server has no figure for (steps, MFU) are left out."""
    out = []
    for label, value in rows:
        if label.startswith(("steps", "MFU")):
            continue
        if label.startswith("J/token"):
            label = "J per output token" + label[len("J/token"):]
        elif label == "tokens":
            label = "output tokens"
        elif label.startswith("energy per 10k tokens"):
            label = "energy per 10k output tokens"
        out.append((label, value))
    s = run.summary
    out += [("prompt tokens", _count(s.get("prompt_tokens"))), ("requests", _count(s.get("requests"))),
            ("J per 1k tokens (prompt + output)", fmt_num(num(s.get("j_per_1k_tokens"))))]
    return out


def serving_blocks(run: RunData) -> list[Any]:
    """The per-model and per-hour tables of a serving session (nothing for a training run)."""
    doc = run.summary.get("serving")
    if not is_serving_run(run) or not isinstance(doc, dict):
        return []
    blocks: list[Any] = [("p", f"Serving session of the {doc.get('engine') or '?'} server at {doc.get('url') or '?'} "
                               f"(process {doc.get('pid') or '?'}): {SERVING_NOTE}.")]
    models = [m for m in doc.get("models") or [] if isinstance(m, dict)]
    if models:
        blocks.append(("h3", "Per model"))
        blocks.append(("table", ["model", "prompt tokens", "output tokens", "requests", "energy",
                                 "J per output token"],
                       [[str(m.get("model") or "(unnamed)"), _count(m.get("prompt_tokens")),
                         _count(m.get("output_tokens")), _count(m.get("requests")), _energy(m.get("energy_j")),
                         fmt_num(num(m.get("j_per_output_token")))] for m in models]))
    hours = [h for h in doc.get("hours") or [] if isinstance(h, dict)]
    if hours:
        blocks.append(("h3", "Per hour (UTC)"))
        blocks.append(("table", ["hour", "prompt tokens", "output tokens", "requests", "energy", "idle energy",
                                 "CO2", "J per output token"],
                       [[str(h.get("hour") or "?"), _count(h.get("prompt_tokens")), _count(h.get("output_tokens")),
                         _count(h.get("requests")), _energy(h.get("energy_j")), _energy(h.get("idle_energy_j")),
                         fmt_co2(num(h.get("co2_g"))), fmt_num(num(h.get("j_per_output_token")))] for h in hours]))
    return blocks
