"""The billing rules of the run ledger, one small function per rule: which part of an interval a run is
charged (window), its energy and idle energy, the dynamic energy above idle, its CO2, the efficiency window
after the warm-up, and its progress to the end of training.

``accounting.integrate`` (one snapshot interval) and ``summary.summarize`` (a run's figures) are compositions of
these. Each function takes plain values (or the small named tuples defined here: immutable, cheap to make on the
sampler thread) and returns new ones; the arithmetic is written exactly as the ledger has always done it, so
that figures stay the same to the last bit. This module never does I/O, never reads a clock, never locks, and
never sees a run, a frame or an accumulator: tests state each rule as a table of plain values
(tests/test_billing.py).

Units: seconds, joules, watts, kWh, g/kWh; ``None`` is "not known", never 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

#: joules in one kWh
J_PER_KWH = 3.6e6

# ----------------------------------------------------------------------------------------------------
# figures that may be unknown


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None when either is unknown or ``den`` is not positive (no rate over no time)."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def max_opt(a: float | None, b: float | None) -> float | None:
    """The larger of two figures, either of which may be unknown (None only when both are)."""
    if a is None:
        return b
    return a if b is None else max(a, b)


def not_finite(figures: Mapping[str, object]) -> list[str]:
    """The names of the figures that are floats but not finite (an overflow, a NaN pushed), in order: a
    figure the ledger cannot state is shown as unknown, never as inf or NaN."""
    return [k for k, v in figures.items() if isinstance(v, float) and not math.isfinite(v)]


# ----------------------------------------------------------------------------------------------------
# window: which part of a snapshot interval a run is charged


class Cut(NamedTuple):
    """The part (a, b] of a snapshot interval of ``span`` seconds that lies in a run (``overlap`` = b - a
    seconds), and of it the part after the warm-up, (wa, b] (``window`` seconds, 0 while in the warm-up)."""

    span: float
    a: float
    b: float
    wa: float
    overlap: float
    window: float


def interval_cut(t0: float, t1: float, lo: float, hi: float, window_start: float) -> Cut | None:
    """The part of the interval (t0, t1] inside the run's [lo, hi]; ``window_start``: the end of the run's
    warm-up. None when the interval has no length or does not overlap the run."""
    a, b = max(t0, lo), min(t1, hi)
    if t1 - t0 <= 0 or b - a <= 0:
        return None
    wa = max(a, window_start)
    return Cut(t1 - t0, a, b, wa, b - a, max(0.0, b - wa))


class Window(NamedTuple):
    """The efficiency window of a run: its duration less the warm-up, when the warm-up applies."""

    duration_s: float
    warmup_s: float  # the warm-up taken off (0 when it does not apply)
    applied: bool

    @property
    def window_s(self) -> float:
        return self.duration_s - self.warmup_s


def efficiency_window(duration_s: float, warmup_s: float) -> Window:
    """The warm-up applies only to a run longer than it; a shorter run's efficiency figures cover all of it
    (and so does every run with no warm-up, whatever a late rank's first point interpolates to)."""
    applied = warmup_s > 0 and duration_s > warmup_s
    return Window(duration_s, warmup_s if applied else 0.0, applied)


def window_count(total: float | None, at_warmup: float | None) -> float | None:
    """A counter's increase over the efficiency window: its total less its value at the warm-up's end (none
    known: nothing before the window)."""
    return total - (at_warmup or 0.0) if total is not None else None


# ----------------------------------------------------------------------------------------------------
# energy


def counter_delta_j(e0: float | None, e1: float | None) -> float | None:
    """The energy counter's increase over an interval; None when either read is missing or the counter went
    back (the interval is not measured: it counts as GPU-time without energy)."""
    if e0 is not None and e1 is not None and e1 >= e0:
        return e1 - e0
    return None


def charged_j(delta_j: float, share_s: float, span_s: float) -> float:
    """A run's energy of one GPU's interval: the counter's delta, spread evenly over the interval's
    ``span_s`` seconds, times the run's share-seconds of it (``split.Charge.share_s``)."""
    return delta_j * share_s / span_s


def energy_coverage(measured_gpu_s: float, expected_gpu_s: float) -> float | None:
    """The part of the run's GPU-time for which a counter was read (below 1: the energy is a lower bound)."""
    return measured_gpu_s / expected_gpu_s if expected_gpu_s > 0 else None


def per_gpu_byte_s(bytes_sum: float, gpus: int, seconds: float) -> float:
    """Memory-seconds of one interval, per GPU (the VRAM average is per GPU, not summed over them)."""
    return bytes_sum / gpus * seconds


def interval_peak_w(peak_w: float | None, joules: float, overlap_s: float, power_w: float | None, *,
                    every_counter_read: bool, inside: bool) -> float | None:
    """The run's peak power after one interval. ``power_w``: the run's share of its GPUs' power read at the
    interval's end, which counts only when that snapshot was taken inside the run (``inside``). Where the
    GPUs report no power, the interval's mean power counts instead, when every GPU's counter was read and
    the run drew energy: never both, as between two counter reads the read carries the correction and one
    short interval's mean can stand far above anything the GPU drew."""
    if every_counter_read and joules > 0 and power_w is None:
        peak_w = max_opt(peak_w, joules / overlap_s)
    if inside and power_w is not None:
        peak_w = max_opt(peak_w, power_w)
    return peak_w


# ----------------------------------------------------------------------------------------------------
# idle and dynamic energy


def idle_j(idle_w: float, share_s: float) -> float:
    """A run's idle energy of one GPU's interval: the GPU's idle power times the run's share-seconds, not
    the seconds it overlapped (two runs sharing a GPU are each charged half of its idle power)."""
    return idle_w * share_s


def idle_total(known_j: float, unknown_s: Mapping[str, float], idle_w: Mapping[str, float | None]) -> float | None:
    """Idle energy: ``known_j`` plus, for the GPU-seconds whose idle power was not known yet, the GPU's idle
    power as known now (``idle_w``: GPU key -> W). None while a GPU with such seconds has none."""
    total = known_j
    for key, seconds in unknown_s.items():
        if seconds <= 0:
            continue
        watts = idle_w.get(key)
        # The baseline is learned while GPUs are idle, often only after the run started: the value
        # learned later applies to the whole run.
        if watts is None:
            return None
        total += watts * seconds
    return total


def dynamic_j(energy_j: float | None, idle: float | None) -> float | None:
    """Energy above idle (unknown while either is); not clamped: below 0 says the idle baseline is wrong."""
    return energy_j - idle if energy_j is not None and idle is not None else None


# ----------------------------------------------------------------------------------------------------
# carbon


class Grid(NamedTuple):
    """The carbon price in force: grid intensity (g/kWh, None: not known) and PUE (None: not known)."""

    intensity: float | None
    pue: float | None


class CarbonPiece(NamedTuple):
    """Energy priced at one intensity and PUE; ``intensity`` None: not known (CO2 is then a lower bound)."""

    kwh: float
    intensity: float | None
    pue: float

    @property
    def co2_g(self) -> float:
        """CO2 = energy (kWh) x PUE x intensity (g/kWh); 0 when the intensity is not known."""
        return self.kwh * self.pue * self.intensity if self.intensity is not None else 0.0


def carbon_pieces(energy_j: float, a: float, b: float, now: Grid, before: Grid,
                  change_at: float | None) -> list[CarbonPiece]:
    """How the energy of (a, b], spread evenly over it, is priced. The intensity in force at ``b``'s
    snapshot (``now``) prices it all, unless it took that value at ``change_at`` inside (a, b): then the part
    before is priced at ``before.intensity``, with ``before.pue`` (the PUE of the interval's start; ``now``'s
    if not known). A PUE not known is 1."""
    pue1 = now.pue if now.pue is not None else 1.0
    if change_at is not None and now.intensity is not None and b > a and a < change_at < b:
        first = (change_at - a) / (b - a)
        pue0 = before.pue if before.pue is not None else pue1
        return [CarbonPiece(energy_j * first / J_PER_KWH, before.intensity, pue0),
                CarbonPiece(energy_j * (1.0 - first) / J_PER_KWH, now.intensity, pue1)]
    return [CarbonPiece(energy_j / J_PER_KWH, now.intensity, pue1)]


class Carbon(NamedTuple):
    """A run's CO2 (g) and the average intensity (g/kWh) and PUE it was priced at, weighted by energy."""

    co2_g: float | None
    intensity: float | None
    pue: float | None


def carbon_figures(co2_g: float, priced_kwh: float, kwh_x_intensity: float, kwh_x_pue: float, *,
                   measured: bool, energy_j: float, configured: bool) -> Carbon:
    """A run's carbon figures from its priced energy: none without measured energy; a run that drew no
    energy where a carbon source is configured emitted 0 g (not unknown)."""
    if measured and priced_kwh > 0:
        return Carbon(co2_g, kwh_x_intensity / priced_kwh, kwh_x_pue / priced_kwh)
    if measured and configured and energy_j == 0:
        return Carbon(0.0, None, None)
    return Carbon(None, None, None)


# ----------------------------------------------------------------------------------------------------
# progress


def step_time_s(histogram_sum: float, histogram_count: float) -> float | None:
    """The mean step time the trainer measured (its step-duration histogram), None before any step."""
    return histogram_sum / histogram_count if histogram_count > 0 else None


class Progress(NamedTuple):
    """How far a run is through its planned steps, and what finishing it takes at its pace so far."""

    progress: float | None  # 0..1
    steps_remaining: float | None
    eta_s: float | None
    energy_to_finish_j: float | None


def progress(done: float | None, total: float | None, *, step_s: float | None, j_per_step: float | None,
             going: bool) -> Progress:
    """``done`` of ``total`` steps (capped at 1, nothing remaining past the end); the time left at
    ``step_s`` a step, only while the run is ``going``; the energy left at ``j_per_step``."""
    fraction = remaining = None
    if done is not None and total is not None and total > 0:
        fraction, remaining = min(done / total, 1.0), max(total - done, 0.0)
    eta = remaining * step_s if remaining is not None and step_s is not None and going else None
    energy = remaining * j_per_step if remaining is not None and j_per_step is not None else None
    return Progress(fraction, remaining, eta, energy)


def mfu(window_flops: float | None, window_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: the FLOP/s achieved over the efficiency window over the GPUs' peak."""
    return ratio(ratio(window_flops, window_s), peak_flops)
