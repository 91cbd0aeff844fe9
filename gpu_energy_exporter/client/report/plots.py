"""The PNG plots of ``gpu-energy-exporter report``: five per run (power per GPU, energy per step, loss
against cumulative energy, memory, tokens/s) and two comparing several runs.

matplotlib (the ``[report]`` extra) is imported only here, with the Agg backend, and only when plotting.
This module writes PNG files under the directory it is given and nothing else; it never computes a
summary figure (those are the ledger's) and never renders text documents.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from gpu_energy_exporter.client.fmt import GIB
from gpu_energy_exporter.client.report.run import ReportError, RunData, num
from gpu_energy_exporter.client.report.series import (
    energy_per_step,
    loss_vs_energy,
    rate_window,
    tokens_per_second,
    vram_per_gpu,
)
from gpu_energy_exporter.core.textfmt import fmt_num

#: Size of every plot, in pixels (inches x DPI): tests check it.
PLOT_SIZE_IN = (10.0, 4.0)
PLOT_DPI = 100
PLOTS: tuple[tuple[str, str], ...] = (
    ("power", "Power over time, per GPU"),
    ("energy_per_step", "Energy per optimizer step"),
    ("loss_vs_energy", "Loss against cumulative energy"),
    ("memory", "GPU memory (VRAM) and host memory over time"),
    ("tokens_per_s", "Throughput (tokens/s) over time"),
)
COMPARISON_PLOTS: tuple[tuple[str, str], ...] = (
    ("comparison", "J/token, tokens/s, energy and average power per run"),
    ("comparison_loss_vs_energy", "Loss against cumulative energy, all runs"),
)


def load_pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; ReportError saying how to install it when missing."""
    try:
        import matplotlib  # noqa: PLC0415 - optional extra, only for this command
    except ImportError:
        raise ReportError(
            "report draws its plots with matplotlib, which is not installed in this Python environment "
            f"({sys.prefix}): install it with `{sys.executable} -m pip install 'matplotlib>=3.7'` (from a "
            "checkout, `make run` and `pip install '.[report]'` include it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _minutes(run: RunData) -> list[float]:
    t0 = run.start if run.start is not None else (run.t[0] if run.t else 0.0)
    return [(t - t0) / 60.0 for t in run.t]


def _energy_unit(max_j: float) -> tuple[float, str]:
    if max_j >= 360_000:
        return 3.6e6, "kWh"
    if max_j >= 1000:
        return 1000.0, "kJ"
    return 1.0, "J"


def _figure(plt: Any, title: str, run: RunData | None = None, ncols: int = 1, nrows: int = 1) -> tuple[Any, Any]:
    fig, ax = plt.subplots(nrows, ncols, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    suffix = "  [SIMULATED DATA]" if run is not None and run.simulated else ""
    fig.suptitle(title + suffix, fontsize=11, color="#b00000" if suffix else "black")
    return fig, ax


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run's data", ha="center", va="center", transform=ax.transAxes,
            color="#666666")


def _whole_run(ax: Any, run: RunData) -> None:
    """Time axes span the whole run, not only the samples at hand: a plot whose samples cover 5 s of a 26 s
    run must show that, not stretch the 5 s across the page."""
    duration = num(run.summary.get("duration_s"))
    if duration is not None and duration > 0:
        ax.set_xlim(0, duration / 60.0)


def _warmup(ax: Any, run: RunData) -> None:
    w = num(run.summary.get("warmup_s"))
    if w:
        ax.axvspan(0, w / 60.0, color="#dddddd", alpha=0.6, lw=0, label="warm-up (not in J/token)")


def _save(fig: Any, path: str) -> str:
    fig.subplots_adjust(left=0.08, right=0.97, top=0.88, bottom=0.14)
    fig.savefig(path, dpi=PLOT_DPI, format="png")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.close(fig)
    return path


def plot_run(run: RunData, out_dir: str, plt: Any) -> dict[str, str]:
    """Write the five plots of one run; returns {plot name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    x = _minutes(run)
    paths: dict[str, str] = {}

    fig, ax = _figure(plt, f"Power per GPU: {run.run_id}", run)
    _warmup(ax, run)
    if run.t and any(v is not None for series in run.power_w for v in series):
        for g, series in zip(run.gpus, run.power_w, strict=True):
            ax.plot(x, [math.nan if v is None else v for v in series], lw=1.2,
                    label=f"{g.get('uuid', '')[:12]}… {str(g.get('name') or '').replace('NVIDIA ', '')}")
        if len(run.power_w) > 1:
            total = [sum(v for v in vals if v is not None) if all(v is not None for v in vals) else math.nan
                     for vals in zip(*run.power_w, strict=True)]
            ax.plot(x, total, lw=1.5, ls="--", color="black", label="all the run's GPUs")
        peak = num(run.summary.get("peak_power_w"))
        avg = num(run.summary.get("avg_power_w"))
        if avg is not None:
            ax.axhline(avg, color="#888888", lw=1, ls=":", label=f"average {avg:,.0f} W")
        if peak is not None:
            ax.set_ylim(0, max(peak, *(v for s in run.power_w for v in s if v is not None)) * 1.1)
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "power samples")
    _whole_run(ax, run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("power (W)")
    ax.grid(alpha=0.3)
    paths["power"] = _save(fig, os.path.join(out_dir, "power.png"))

    fig, ax = _figure(plt, f"Energy per optimizer step: {run.run_id}", run)
    eps = energy_per_step(run)
    if eps:
        ax.plot([s for s, _ in eps], [j for _, j in eps], marker=".", lw=1, color="#d95f02",
                label=f"over {rate_window(run):.0f} s windows")
        energy, steps = num(run.summary.get("energy_j")), num(run.summary.get("steps"))
        if energy is not None and steps:
            ax.axhline(energy / steps, color="#888888", ls=":", lw=1, label=f"run mean {energy / steps:,.1f} J/step")
        ax.legend(loc="lower right", fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax, "step counts")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("energy per step (J)")
    ax.grid(alpha=0.3)
    paths["energy_per_step"] = _save(fig, os.path.join(out_dir, "energy_per_step.png"))

    fig, ax = _figure(plt, f"Loss against cumulative energy: {run.run_id}", run)
    lve = loss_vs_energy(run)
    if lve and max(e for e, _ in lve) > 0:
        scale, unit = _energy_unit(max(e for e, _ in lve))
        ax.plot([e / scale for e, _ in lve], [v for _, v in lve], marker=".", lw=1, color="#1b9e77")
        ax.set_xlabel(f"cumulative GPU energy of the run ({unit})")
    else:
        _no_data(ax, "loss values" if not lve else "GPU energy (the run's GPUs reported none)")
        ax.set_xlabel("cumulative GPU energy of the run")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    paths["loss_vs_energy"] = _save(fig, os.path.join(out_dir, "loss_vs_energy.png"))

    fig, ax = _figure(plt, f"Memory: {run.run_id}", run)
    has_vram = any(v is not None for v in run.vram_bytes)
    has_host = any(v is not None for v in run.host_available_bytes)
    if has_vram:
        # Per GPU throughout, like the report's table: the mean over the run's GPUs, the peak on any one
        # GPU, and one GPU's total (a sum over GPUs drawn against one GPU's total stood above "total").
        per_gpu = "per GPU" if len(run.gpus) <= 1 else f"per GPU (mean of {len(run.gpus)})"
        ax.plot(x, [math.nan if v is None else v / GIB for v in vram_per_gpu(run)], lw=1.4, color="#7570b3",
                label=f"VRAM used {per_gpu} (GiB)")
        vram_peak = num(run.summary.get("vram_peak_bytes"))
        if vram_peak:
            ax.axhline(vram_peak / GIB, color="#7570b3", ls="--", lw=1,
                       label=f"VRAM peak, one GPU {vram_peak / GIB:.1f} GiB")
        vram_total = num(run.summary.get("vram_total_bytes"))
        if vram_total:
            ax.axhline(vram_total / GIB, color="#7570b3", ls=":", lw=1,
                       label=f"VRAM total, one GPU {vram_total / GIB:.0f} GiB")
    if has_host:
        ax.plot(x, [math.nan if v is None else v / GIB for v in run.host_available_bytes], lw=1.4,
                color="#e7298a", label="host RAM available (GiB)")
        if run.host_critical_bytes:
            ax.axhline(run.host_critical_bytes / GIB, color="#e7298a", ls="--", lw=1,
                       label=f"host RAM critical {run.host_critical_bytes / GIB:.1f} GiB")
    if has_vram or has_host:
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "memory samples")
    _whole_run(ax, run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3)
    paths["memory"] = _save(fig, os.path.join(out_dir, "memory.png"))

    fig, ax = _figure(plt, f"Throughput: {run.run_id}", run)
    _warmup(ax, run)
    tps = tokens_per_second(run)
    if tps:
        t0 = run.start if run.start is not None else run.t[0]
        xs = [(a - t0) / 60.0 for a, _, _ in tps] + [(tps[-1][1] - t0) / 60.0]
        ys = [v for _, _, v in tps] + [tps[-1][2]]
        ax.step(xs, ys, where="post", lw=1.4, color="#66a61e", label=f"over {rate_window(run):.0f} s windows")
        window = num(run.summary.get("tokens_per_s"))
        if window is not None:
            ax.axhline(window, color="#888888", ls=":", lw=1, label=f"ledger {window:,.0f} tokens/s (after warm-up)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax, "token counts")
    _whole_run(ax, run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    paths["tokens_per_s"] = _save(fig, os.path.join(out_dir, "tokens_per_s.png"))
    return paths


def _bar_labels(runs: Sequence[RunData]) -> list[str]:
    """Short x labels: the backends when they tell the runs apart, else #1, #2 (the legend names them)."""
    backends = [str(r.summary.get("backend") or "") for r in runs]
    if all(backends) and len(set(backends)) == len(backends):
        return backends
    return [f"#{i}" for i in range(1, len(runs) + 1)]


def plot_comparison(runs: Sequence[RunData], out_dir: str, plt: Any) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    labels = _bar_labels(runs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sim = any(r.simulated for r in runs)
    fig, axes = plt.subplots(1, 4, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    fig.suptitle("Runs compared" + ("  [SIMULATED DATA]" if sim else ""), fontsize=11,
                 color="#b00000" if sim else "black")
    for ax, (key, title, scale) in zip(axes, (
            ("j_per_token", "J/token", 1.0), ("tokens_per_s", "tokens/s", 1.0),
            ("energy_kwh", "energy (kWh)", 1.0), ("avg_power_w", "average power (W)", 1.0)), strict=True):
        figures = [num(r.summary.get(key)) for r in runs]
        values = [(v or 0.0) * scale for v in figures]
        bars = ax.bar(range(len(runs)), values, color=[colours[i % len(colours)] for i in range(len(runs))])
        # the figure on each bar, as report.md prints it: bars of near-equal height read the same otherwise
        ax.bar_label(bars, labels=[fmt_num(None if v is None else v * scale) for v in figures], fontsize=7,
                     padding=2)
        ax.margins(y=0.15)  # room above the tallest bar for its label
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(labels, fontsize=8, rotation=15 if len(runs) > 2 else 0)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    key = "   ".join(f"{label}: {r.run_id}" for label, r in zip(labels, runs, strict=True))
    fig.text(0.5, 0.03, key if len(key) < 160 else key[:157] + "...", ha="center", fontsize=7, color="#444444")
    fig.subplots_adjust(left=0.06, right=0.98, top=0.82, bottom=0.2, wspace=0.45)
    path = os.path.join(out_dir, "comparison.png")
    fig.savefig(path, dpi=PLOT_DPI, format="png")
    plt.close(fig)
    paths = {"comparison": path}

    fig, ax = _figure(plt, "Loss against cumulative energy, all runs")
    if sim:
        fig.suptitle("Loss against cumulative energy, all runs  [SIMULATED DATA]", fontsize=11, color="#b00000")
    curves = [(r, loss_vs_energy(r)) for r in runs]
    top = max((e for _, c in curves for e, _ in c), default=0.0)
    scale, unit = _energy_unit(top)
    for i, (r, c) in enumerate(curves):
        if c:
            ax.plot([e / scale for e, _ in c], [v for _, v in c], marker=".", lw=1, color=colours[i % len(colours)],
                    label=r.label)
    if any(c for _, c in curves):
        ax.legend(loc="upper right", fontsize=8)
    else:
        _no_data(ax, "loss values")
    ax.set_xlabel(f"cumulative GPU energy of the run ({unit})")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    paths["comparison_loss_vs_energy"] = _save(fig, os.path.join(out_dir, "comparison_loss_vs_energy.png"))
    return paths
