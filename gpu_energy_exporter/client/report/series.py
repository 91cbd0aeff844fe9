"""Derived series of ``gpu-energy-exporter report``: tokens/s and energy per step over windows, and loss
against cumulative energy, computed from a run's timeline.

Pure: plain values in, lists of tuples out. This module never does I/O, never plots and never formats.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_energy_exporter.client.report.run import RunData


def change_points(t: Sequence[float], values: Sequence[float | None]) -> list[tuple[float, float]]:
    """(t, value) where the value changed: counters and gauges pushed over OTLP move only when an export
    arrives, so rates between consecutive change points are exact, and between snapshots they are not."""
    out: list[tuple[float, float]] = []
    for ti, v in zip(t, values, strict=True):
        if v is None:
            continue
        if not out or v != out[-1][1]:
            out.append((ti, v))
    return out


def vram_per_gpu(run: RunData) -> list[float | None]:
    """GPU memory used per GPU at each timeline point (bytes): the timeline holds the sum over the run's
    GPUs, and the report's other memory figures (the ledger's VRAM peak and average, ``vram_total_bytes``)
    are per GPU, so the plot divides by the number of GPUs rather than set a sum against one GPU's total."""
    n = max(1, len(run.gpus))
    return [None if v is None else v / n for v in run.vram_bytes]


def rate_window(run: RunData) -> float:
    """Seconds over which rates are averaged: counters move only when an export arrives and snapshots come
    every second, so shorter windows show the two clocks beating against each other, not the run."""
    span = (run.t[-1] - run.t[0]) if len(run.t) > 1 else 0.0
    return max(5.0, span / 60.0)


def _windows(points: Sequence[tuple[float, ...]], min_dt: float) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
    """Consecutive (first, last) pairs of ``points`` (sorted by their first item, time) at least ``min_dt``
    apart; a short remainder at the end joins the last window."""
    out: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
    if len(points) < 2:
        return out
    a = points[0]
    for b in points[1:]:
        if b[0] - a[0] >= min_dt:
            out.append((a, b))
            a = b
    last = points[-1]
    if a is not last:
        if out and last[0] - a[0] < min_dt / 2:
            out[-1] = (out[-1][0], last)
        else:
            out.append((a, last))
    return out


def tokens_per_second(run: RunData) -> list[tuple[float, float, float]]:
    """(window start, window end, tokens/s) over windows of ``rate_window`` seconds."""
    pts = change_points(run.t, run.tokens)
    return [(a[0], b[0], (b[1] - a[1]) / (b[0] - a[0])) for a, b in _windows(pts, rate_window(run))
            if b[0] > a[0] and b[1] >= a[1]]


def energy_per_step(run: RunData) -> list[tuple[float, float]]:
    """(step at the window's end, joules per step) over windows of ``rate_window`` seconds, taken where the
    step count changed."""
    pts: list[tuple[float, ...]] = []
    for t, s, e in zip(run.t, run.steps, run.energy_j, strict=True):
        if s is None or e is None:
            continue
        if not pts or s != pts[-1][1]:
            pts.append((t, s, e))
    return [(b[1], (b[2] - a[2]) / (b[1] - a[1])) for a, b in _windows(pts, rate_window(run)) if b[1] > a[1]]


def loss_vs_energy(run: RunData) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    last: float | None = None
    for loss, e in zip(run.loss, run.energy_j, strict=True):
        if loss is None or e is None or loss == last:
            continue
        out.append((e, loss))
        last = loss
    return out
