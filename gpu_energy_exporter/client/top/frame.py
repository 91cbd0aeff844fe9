"""The frame of ``gpu-energy-exporter top``: what the exporter's JSON documents become on screen, as lines
of (text, style) segments shared by the curses view and the plain-text frames.

Pure: from a ``View`` (the last ``/api/v1/status`` and ``/api/v1/runs`` documents) to lines, with the
width, the character set and the clock as arguments. This module never touches a terminal, never does
network I/O and never starts a thread (``poller.py`` fetches, ``screen.py`` draws).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.client.fmt import (
    SERVING_NOTE,
    fmt_co2,
    fmt_duration,
    fmt_gib,
    fmt_mfu,
    is_provisional,
    is_serving,
    provisional,
    rank_coverage,
)
from gpu_energy_exporter.core.textfmt import fmt_num, printable


def fmt_energy(joules: float | None) -> str:
    """Energy in kWh everywhere in the view (the unit of the carbon intensity and of the bill), with
    enough decimals for a short run: one unit, so the header and the rows can be compared."""
    if joules is None or not math.isfinite(joules):
        return "-"
    kwh = joules / 3.6e6
    if abs(kwh) >= 100:
        return f"{kwh:,.1f} kWh"
    if abs(kwh) >= 1:
        return f"{kwh:.3f} kWh"
    return f"{kwh:.4f} kWh"


def eta_seconds(run: dict[str, Any]) -> float | None:
    """Time left from the planned total steps and the pace so far (mean step time where the trainer pushed
    it, else elapsed / steps); None when the plan is unknown."""
    total, steps = run.get("total_steps"), run.get("steps")
    if not isinstance(total, (int, float)) or not isinstance(steps, (int, float)) or steps <= 0 or total <= 0:
        return None
    if steps >= total:
        return 0.0
    pace = run.get("mean_step_s")
    if not isinstance(pace, (int, float)) or pace <= 0:
        duration = run.get("duration_s")
        if not isinstance(duration, (int, float)) or duration <= 0:
            return None
        pace = duration / steps
    return (total - steps) * float(pace)


# ----------------------------------------------------------------------------------------------------
# the frame: lines of (text, style) segments, shared by the curses and the plain-text outputs

Segment = tuple[str, str]
Line = list[Segment]

#: Styles used in frames; curses maps them to colours, plain text ignores them.
STYLES = ("", "title", "head", "dim", "ok", "warn", "bad", "sim", "bold")


@dataclass
class View:
    """What the last successful fetch returned, and what went wrong since."""

    status: dict[str, Any] | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    fetched_at: float | None = None  # monotonic
    error: str | None = None  # the last fetch failed (the data above may be older)
    failures: int = 0


def _level(frac: float | None, warn: float = 0.7, bad: float = 0.9) -> str:
    if frac is None:
        return "dim"
    return "bad" if frac >= bad else "warn" if frac >= warn else "ok"


def bar(frac: float | None, width: int, unicode: bool = True) -> str:
    """``[█████·····]``-style bar of ``width`` cells inside the brackets (ASCII ``#`` / ``.`` fallback)."""
    width = max(1, width)
    if frac is None or not math.isfinite(frac):
        return "[" + "?".center(width, " ") + "]"
    frac = min(1.0, max(0.0, frac))
    full_ch, empty_ch = ("█", "·") if unicode else ("#", ".")
    filled = int(round(frac * width))
    return "[" + full_ch * filled + empty_ch * (width - filled) + "]"


def _ratio(num: Any, den: Any) -> float | None:
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or den <= 0:
        return None
    return float(num) / float(den)


def _pad(text: str, width: int, right: bool = False) -> str:
    if len(text) > width:
        return text[: max(0, width - 1)] + "…" if width > 1 else text[:width]
    return text.rjust(width) if right else text.ljust(width)


def _pad_middle(text: str, width: int) -> str:
    """Shorten in the middle: run ids differ at both ends (a prefix and a time or backend suffix)."""
    if len(text) <= width:
        return text.ljust(width)
    if width < 5:
        return text[:width]
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


#: What an ASCII-only terminal (LANG=C over SSH, --ascii) gets instead of the few non-ASCII characters.
_ASCII = str.maketrans({"·": "|", "…": "~", "°": " ", "█": "#"})


def render_frame(view: View, *, url: str, interval: float, width: int = 100, unicode: bool = True,
                 now: float | None = None, clock: Callable[[], float] = time.monotonic,
                 once: bool = False) -> list[Line]:
    """The whole screen as lines of styled segments (pure: no terminal, no network). ``once``: a single
    frame (``--once``), which never retries."""
    lines = _frame(view, url=url, interval=interval, width=width, unicode=unicode, now=now, clock=clock,
                   once=once)
    if not unicode:
        lines = [[(text.translate(_ASCII), style) for text, style in line] for line in lines]
    return lines


def _frame(view: View, *, url: str, interval: float, width: int, unicode: bool, now: float | None,
           clock: Callable[[], float], once: bool = False) -> list[Line]:
    width = max(40, width)
    wall = time.time() if now is None else now
    lines: list[Line] = []
    header = f" gpu-energy-exporter top   {url}   {time.strftime('%H:%M:%S', time.localtime(wall))}   " \
             f"every {interval:g}s"
    keys = "q: quit "
    lines.append([(_pad(header, width - len(keys)) + keys, "title")])
    status = view.status
    if status is None:
        if view.error:
            lines += [[("", "")], [(view.error, "bad")]]
            if not once:
                lines.append([(f"retrying every {interval:g}s (attempt {view.failures})", "dim")])
        else:
            lines.append([("connecting…" if unicode else "connecting...", "dim")])
        return lines
    stale: str | None = None
    if view.error:
        # The exporter stopped answering: what follows is the last answer, greyed out and dated, so a
        # figure such as "now 1,017 W" is never taken for a live one.
        stale = fmt_age(clock() - view.fetched_at if view.fetched_at is not None else 0.0)
        lines.append([(f"! {view.error}", "bad")])
        lines.append([(f"  STALE: the figures below are the last answer, {stale} old (greyed out); "
                       f"retrying every {interval:g}s (attempt {view.failures})", "warn")])
    body: list[Line] = []
    if status.get("simulated"):
        body.append([(" SIMULATED DATA: these GPUs are simulated by `gpu-energy-exporter demo`, not measured ",
                      "sim")])
    body.append([("", "")])
    body += _gpu_lines(status, width, unicode, stale)
    body.append([("", "")])
    body += _run_lines(view.runs, width, stale=stale)
    body.append([("", "")])
    body += _host_lines(status, width, unicode)
    if stale is not None:  # the SIMULATED mark stays as loud as ever
        body = [[(text, style if style == "sim" else "dim") for text, style in line] for line in body]
    return lines + body


def fmt_age(seconds: float) -> str:
    """How old the last answer is: ``12s``, ``3m05s``, ``2h07m``."""
    total = max(0, int(round(seconds)))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def _gpu_lines(status: dict[str, Any], width: int, unicode: bool, stale: str | None = None) -> list[Line]:
    gpus = status.get("gpus") or []
    nvml = status.get("nvml") or {}
    out: list[Line] = []
    total_w = sum(g["power_w"] for g in gpus if isinstance(g.get("power_w"), (int, float)))
    total_j = sum(g["energy_j"] for g in gpus if isinstance(g.get("energy_j"), (int, float)))
    title = f"GPUs ({len(gpus)})"
    if gpus:
        when = f"{stale} ago" if stale is not None else "now"
        title += f"   {when} {total_w:,.0f} W   energy counters {fmt_energy(total_j)}"
    out.append([(title, "head")])
    if not gpus:
        reason = nvml.get("reason") or "no GPU found"
        out.append([(f"  no GPUs: NVML unavailable ({reason}); see the exporter's log. "
                     "Try `gpu-energy-exporter demo` for simulated GPUs.", "warn")])
        return out
    names = [str(g.get("name") or "").replace("NVIDIA ", "") for g in gpus]
    # Everything but the name and the three bars takes 61 columns; the bars share what is left with the
    # name, which is shortened last.
    rest = width - 61
    name_need = min(34, max(len(n) for n in names))
    bar_w = max(8 if rest >= 40 else 5, min(20, (rest - name_need) // 3))
    name_w = max(8, min(name_need, rest - 3 * bar_w))
    head = (" # " + _pad("model", name_w) + " " + _pad("power", bar_w + 2) + " " + _pad("W / limit", 10) + " "
            + _pad("energy", 10, right=True) + "  " + _pad("utilisation", bar_w + 2) + " " + " " * 5
            + _pad("temp", 5, right=True) + "  " + "VRAM")
    out.append([(head, "dim")])
    for g, name in zip(gpus, names, strict=True):
        idx = str(g.get("index", "?"))
        if not g.get("up", True):
            out.append([(f"{idx:>2} ", "bold"), (_pad(name, name_w) + " ", ""),
                        (f"DOWN: {g.get('error') or 'not answering'}", "bad")])
            continue
        power, limit = g.get("power_w"), g.get("power_limit_w")
        pfrac = _ratio(power, limit)
        util = g.get("utilization")
        used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
        mfrac = _ratio(used, total)
        temp = g.get("temperature_c")
        ptext = f"{power:.0f}" if isinstance(power, (int, float)) else "-"
        ltext = f"/{limit:.0f} W" if isinstance(limit, (int, float)) else " W"
        util_ok = isinstance(util, (int, float))
        line: Line = [
            (f"{idx:>2} ", "bold"), (_pad(name, name_w) + " ", ""),
            (bar(pfrac, bar_w, unicode), _level(pfrac, 0.8, 0.95)), (" " + _pad(ptext + ltext, 10) + " ", ""),
            (_pad(fmt_energy(g.get("energy_j")), 10, right=True) + "  ", ""),
            (bar(util if util_ok else None, bar_w, unicode), "ok" if util else "dim"),
            (" " + (_pad(f"{util * 100:.0f}%", 4, right=True) if util_ok else "   -") + " ", ""),
            (_pad(f"{temp:.0f}°C" if isinstance(temp, (int, float)) else "-", 5, right=True) + "  ",
             _level(temp / 100 if isinstance(temp, (int, float)) else None, 0.8, 0.87)),
            (bar(mfrac, bar_w, unicode), _level(mfrac)),
            (f" {fmt_gib(used)}/{fmt_gib(total)} GiB", ""),
        ]
        out.append(line)
        if g.get("error"):
            out.append([("   " + str(g["error"]), "warn")])
    return out


#: Run table columns after the run id: (header, width, right-aligned).
_RUN_COLS: tuple[tuple[str, int, bool], ...] = (
    ("steps", 13, True), ("loss", 7, True), ("tok/s", 8, True), ("J/token", 8, True), ("elapsed", 8, True),
    ("ETA", 8, True), ("energy", 11, True), ("CO2", 8, True),
)


def _run_cells(r: dict[str, Any]) -> list[str]:
    steps, total = r.get("steps"), r.get("total_steps")
    steps_text = f"{steps:,.0f}" if isinstance(steps, (int, float)) else "-"
    if isinstance(total, (int, float)) and total > 0:
        steps_text += f"/{total:,.0f}"
    if is_serving(r):
        steps_text = "serving"  # a server has no steps: its kind, beside the run id
    active = r.get("status") in ("running", "finishing")
    loss = r.get("last_loss")
    return [
        steps_text, f"{loss:.3f}" if isinstance(loss, (int, float)) else "-",
        fmt_num(r.get("tokens_per_s")), provisional(fmt_num(r.get("j_per_token")), r),
        fmt_duration(r.get("duration_s")),
        fmt_duration(eta_seconds(r)) if active else str(r.get("status") or ""),
        provisional(fmt_energy(r.get("energy_j")), r), provisional(fmt_co2(r.get("co2_g")), r),
    ]


#: Columns dropped first when the terminal is narrow (the run id keeps at least 12 columns).
_DROP_ORDER = ("energy", "elapsed", "loss", "CO2", "tok/s")


def _visible_cols(width: int) -> list[int]:
    keep = list(range(len(_RUN_COLS)))
    for name in _DROP_ORDER:
        if 20 + sum(_RUN_COLS[i][1] + 1 for i in keep) <= width:
            break
        keep = [i for i in keep if _RUN_COLS[i][0] != name]
    return keep


def _row(run_id: str, run_w: int, cells: Sequence[str], keep: Sequence[int], width: int) -> str:
    parts = [_pad_middle(run_id, run_w)] + [_pad(cells[i], _RUN_COLS[i][1], _RUN_COLS[i][2]) for i in keep]
    return " ".join(parts)[:width]


def _run_lines(runs: list[dict[str, Any]], width: int, max_finished: int = 3, stale: str | None = None
               ) -> list[Line]:
    active = [r for r in runs if r.get("status") in ("running", "finishing")]
    done = [r for r in runs if r.get("status") not in ("running", "finishing")][-max_finished:]
    kind = "RUNS AND SERVING SESSIONS" if any(is_serving(r) for r in runs) else "TRAINING RUNS"
    title = f"{kind} ({len(active)} active" + (f", {len(done)} recent)" if done else ")")
    out: list[Line] = [[(title + (f"   as of {stale} ago" if stale is not None else ""), "head")]]
    if not runs:
        out.append([("  no training run has pushed to this exporter yet (gpu_energy_exporter.training, "
                     "or the Hugging Face / Lightning callbacks)", "dim")])
        return out
    keep = _visible_cols(width)
    fixed = sum(_RUN_COLS[i][1] + 1 for i in keep)
    ids = [str(r.get("run_id") or "?") for r in (*active, *done)]
    run_w = max(12, min(max(len(i) for i in ids), width - fixed))
    out.append([(_row("run", run_w, [c[0] for c in _RUN_COLS], keep, width), "dim")])
    for r in active:
        out.append([(_row(str(r.get("run_id") or "?"), run_w, _run_cells(r), keep, width), "bold")])
        about = [str(r[k]) for k in ("model", "backend", "precision") if r.get(k)]
        if is_serving(r):
            about = ["serving", *about, SERVING_NOTE]
            if isinstance(r.get("prompt_tokens"), (int, float)):
                about.append(f"{r['prompt_tokens']:,.0f} prompt tokens")
        if isinstance(r.get("gpu_count"), (int, float)):
            about.append(f"{r['gpu_count']:.0f} GPU(s)")
        avg = r.get("avg_power_w")
        if isinstance(avg, (int, float)):
            about.append(f"avg {avg:,.0f} W")
        coverage = rank_coverage(r)
        if coverage is not None:
            about.append(f"{coverage}: figures cover those ranks only")
        if isinstance(r.get("mfu"), (int, float)):
            about.append(f"MFU {fmt_mfu(r['mfu'])}")
        if "shorter than the warm-up" in (r.get("ledger_notes") or "") and not is_serving(r):
            about.append("in warm-up: J/token and tok/s cover the run so far")
        if is_provisional(r):
            about.append(f"~{fmt_energy(r.get('energy_provisional_j'))} provisional (settled at the next counter read)")
        if about:
            out.append([("  " + " · ".join(about), "dim")])
    for r in done:
        out.append([(_row(str(r.get("run_id") or "?"), run_w, _run_cells(r), keep, width), "dim")])
        coverage = rank_coverage(r)
        if coverage is not None:
            out.append([(f"  {coverage}: figures cover those ranks only", "dim")])
    return out


def _host_lines(status: dict[str, Any], width: int, unicode: bool) -> list[Line]:
    host = status.get("host") or {}
    carbon = status.get("carbon") or {}
    total, avail = host.get("memory_total_bytes"), host.get("memory_available_bytes")
    critical = host.get("memory_critical_bytes")
    cpu = host.get("cpu_utilization")
    used_frac = 1 - avail / total if isinstance(avail, (int, float)) and isinstance(total, (int, float)) \
        and total > 0 else None
    low = isinstance(avail, (int, float)) and isinstance(critical, (int, float)) and avail < critical
    bar_w = max(8, min(16, (width - 80) // 2))
    line: Line = [("HOST  ", "head")]
    if isinstance(cpu, (int, float)):
        line += [("CPU ", ""), (bar(cpu, bar_w, unicode), _level(cpu)), (f" {cpu * 100:3.0f}%   ", "")]
    used = total - avail if isinstance(avail, (int, float)) and isinstance(total, (int, float)) else None
    line += [("RAM used ", ""), (bar(used_frac, bar_w, unicode), "bad" if low else _level(used_frac, 0.85, 0.95)),
             (f" {fmt_gib(used)} of {fmt_gib(total)} GiB, {fmt_gib(avail)} GiB available", "bad" if low else "")]
    if isinstance(critical, (int, float)):
        line.append((f" (warns < {fmt_gib(critical)} GiB)", "dim"))
    out = [line]
    if low:
        out.append([(f"  WARNING: host RAM available {fmt_gib(avail)} GiB is below the critical threshold "
                     f"{fmt_gib(critical)} GiB: the kernel may soon kill the training process (out of memory)",
                     "bad")])
    intensity, pue = carbon.get("intensity_g_per_kwh"), carbon.get("pue")
    if isinstance(intensity, (int, float)):
        text = f"CARBON {intensity:.0f} gCO2e/kWh ({carbon.get('source') or '?'})"
        if isinstance(pue, (int, float)):
            text += f", PUE {pue:.2f}"
        out.append([(text, "dim")])
    return out


def frame_text(lines: Sequence[Line]) -> str:
    # run ids, labels and notes came over OTLP: no control character reaches the terminal
    return "\n".join(printable("".join(text for text, _ in line), keep_newlines=False).rstrip()
                     for line in lines) + "\n"
