"""Energy accounting of one run over one snapshot interval: pure arithmetic on plain values.

``integrate`` adds the part of a snapshot interval (f0, f1] that lies in a run's [lo, hi] to the run's
accumulator ``Acc``: each GPU's energy counter delta times the run's share of the GPU (``ledger.split``),
idle energy, GPU-time with and without a counter, VRAM, peak power and CO2. ``Acc`` holds only plain
values so it can be copied as a checkpoint; ``Timeline`` is the bounded per-run series behind the reports.

Like ``kubernetes/attribution.py`` and ``ledger/split.py``, this module takes frames and holdings and
returns numbers: no locks, no threads, no I/O, no clock. It never integrates power into energy (power only
bounds the peak) and never reads a GPU reading: frames (``ledger.frames``) carry base units.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_energy_exporter.ledger import split as ledger_split
from gpu_energy_exporter.ledger.frames import Frame, GPUFrame
from gpu_energy_exporter.ledger.split import Holding


@dataclass(slots=True)
class Acc:
    """What a run has accumulated up to time ``t``. Copied as checkpoints, so only plain values."""

    t: float
    energy_j: float = 0.0
    win_energy_j: float = 0.0
    idle_j: float = 0.0
    win_idle_j: float = 0.0
    # seconds per GPU during which its idle power was not known yet (filled in with the last known value)
    idle_unknown_s: dict[str, float] = field(default_factory=dict)
    win_idle_unknown_s: dict[str, float] = field(default_factory=dict)
    expected_gpu_s: float = 0.0
    measured_gpu_s: float = 0.0
    vram_byte_s: float = 0.0
    vram_s: float = 0.0
    vram_peak: float | None = None
    peak_power_w: float | None = None
    co2_g: float = 0.0
    carbon_kwh: float = 0.0  # energy that had an intensity, kWh
    carbon_weighted_intensity: float = 0.0  # sum of kWh x intensity
    carbon_weighted_pue: float = 0.0  # sum of kWh x pue
    carbon_missing_kwh: float = 0.0
    per_gpu_j: dict[str, float] = field(default_factory=dict)
    # seconds per GPU its claim went unconfirmed (charged nothing) / was charged on the claim alone
    unconfirmed_s: dict[str, float] = field(default_factory=dict)
    unverified_s: dict[str, float] = field(default_factory=dict)

    def copy(self) -> Acc:
        return replace(self, idle_unknown_s=dict(self.idle_unknown_s),
                       win_idle_unknown_s=dict(self.win_idle_unknown_s), per_gpu_j=dict(self.per_gpu_j),
                       unconfirmed_s=dict(self.unconfirmed_s), unverified_s=dict(self.unverified_s))


class Timeline:
    """A bounded series of points covering the whole run: when full, every other point is dropped and
    from then on only every other new point is kept, so resolution halves but coverage stays complete."""

    def __init__(self, max_points: int) -> None:
        if max_points < 4:
            raise ValueError("a timeline needs room for at least 4 points")
        self.max_points = max_points
        self.points: list[tuple[Any, ...]] = []
        self.stride = 1
        self._seen = 0

    def add(self, point: tuple[Any, ...], force: bool = False) -> None:
        self._seen += 1
        if not force and (self._seen - 1) % self.stride:
            return
        self.points.append(point)
        if len(self.points) >= self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def trim_after(self, t: float) -> None:
        self.points = [p for p in self.points if p[0] <= t]


@dataclass(slots=True)
class Segment:
    """What one interval told about the run besides its figures (for its bookkeeping)."""

    gpus: list[tuple[str, GPUFrame]]  # the run's GPUs in the interval's second frame (key, frame), in order
    splits: set[str]  # split rules used (ledger_split)
    sharers: set[str]  # other runs sharing those GPUs
    vram_sum: float | None  # memory used, summed over those GPUs, at f1
    inside: bool  # f1 was taken inside the run: its instantaneous values belong to it
    unconfirmed: dict[str, str] = field(default_factory=dict)  # GPU key -> why its claim was not charged
    silent: set[int] = field(default_factory=set)  # pids of processes that are no run's on its GPUs


def integrate(acc: Acc, f0: Frame, f1: Frame, lo: float, hi: float, *, run_id: str, window_start: float,
              keys: Sequence[str], holders: Mapping[str, Sequence[Holding]]) -> Segment | None:
    """Add the part of the snapshot interval (f0, f1] that lies in [lo, hi] to ``acc``.

    ``keys``: the run's GPUs as frame keys (MIG instances mapped to their parent); ``holders``: physical GPU
    key -> the runs using it; ``window_start``: the end of the warm-up. None when the interval adds
    nothing (it lies outside [lo, hi])."""
    span = f1.t - f0.t
    a, b = max(f0.t, lo), min(f1.t, hi)
    overlap = b - a
    if span <= 0 or overlap <= 0:
        return None
    wa = max(a, window_start)
    win = max(0.0, b - wa)
    seg = Segment([], set(), set(), None, lo < f1.t <= hi)
    power_sum: float | None = None
    vram_sum: float | None = None
    vram_max: float | None = None
    vram_n = 0
    segment_j = 0.0
    measured_all = True
    for key in keys:
        g0, g1 = f0.gpus.get(key), f1.gpus.get(key)
        if g1 is None:
            continue  # not a GPU of this node: its energy is another exporter's
        acc.expected_gpu_s += overlap
        seg.gpus.append((key, g1))
        hs = holders.get(key, [])
        share = ledger_split.charge(run_id, f0.t, f1.t, a, b, hs, g1.procs)
        win_share_s = ledger_split.charge(run_id, f0.t, f1.t, wa, b, hs, g1.procs).share_s if win > 0 else 0.0
        seg.splits |= share.splits
        seg.sharers |= share.sharers
        if share.unconfirmed_s > 0:
            acc.unconfirmed_s[key] = acc.unconfirmed_s.get(key, 0.0) + share.unconfirmed_s
            seg.unconfirmed[key] = share.reason
        seg.silent |= share.silent
        if share.unverified_s > 0:
            acc.unverified_s[key] = acc.unverified_s.get(key, 0.0) + share.unverified_s
        if g0 is not None and g0.energy_j is not None and g1.energy_j is not None \
                and g1.energy_j >= g0.energy_j:
            delta = g1.energy_j - g0.energy_j
            joules = delta * share.share_s / span
            acc.energy_j += joules
            acc.win_energy_j += delta * win_share_s / span
            acc.per_gpu_j[key] = acc.per_gpu_j.get(key, 0.0) + joules
            acc.measured_gpu_s += overlap
            segment_j += joules
        else:
            measured_all = False
        if g1.idle_w is not None:
            acc.idle_j += g1.idle_w * share.share_s
            acc.win_idle_j += g1.idle_w * win_share_s
        else:
            acc.idle_unknown_s[key] = acc.idle_unknown_s.get(key, 0.0) + share.share_s
            acc.win_idle_unknown_s[key] = acc.win_idle_unknown_s.get(key, 0.0) + win_share_s
        if g1.power_w is not None:
            now_share = ledger_split.piece_shares([h for h in hs if h.start <= f1.t <= h.end], g1.procs, f1.t)
            power_sum = (power_sum or 0.0) + g1.power_w * now_share.get(run_id, (0.0, ""))[0]
        if g1.memory_used is not None:
            vram_sum = (vram_sum or 0.0) + g1.memory_used
            vram_max = max_opt(vram_max, float(g1.memory_used))
            vram_n += 1
    if vram_sum is not None:
        acc.vram_byte_s += vram_sum / vram_n * overlap  # per GPU
        acc.vram_s += overlap
    seg.vram_sum = vram_sum
    # The interval's mean power counts only where the run's GPUs report no power: between two counter reads
    # the energy is apportioned and the sample that reads the counter carries the correction, so one short
    # interval's mean can stand far above anything the GPU drew (2,129 W on a 700 W H100 at a 200 ms
    # interval, docs/gpu-validation.md). The summary keeps the peak at or above the run's average power.
    if measured_all and segment_j > 0 and power_sum is None:
        acc.peak_power_w = max_opt(acc.peak_power_w, segment_j / overlap)
    # A snapshot's instantaneous values belong to the run only if it was taken inside the run.
    if seg.inside:
        if power_sum is not None:
            acc.peak_power_w = max_opt(acc.peak_power_w, power_sum)
        if vram_max is not None:
            acc.vram_peak = max_opt(acc.vram_peak, vram_max)
    for fraction, intensity, pue in carbon_parts(f0, f1, a, b):
        kwh = segment_j * fraction / 3.6e6
        if intensity is None:
            acc.carbon_missing_kwh += kwh
            continue
        acc.co2_g += kwh * pue * intensity
        acc.carbon_kwh += kwh
        acc.carbon_weighted_intensity += kwh * intensity
        acc.carbon_weighted_pue += kwh * pue
    return seg


def carbon_parts(f0: Frame, f1: Frame, a: float, b: float) -> list[tuple[float, float | None, float]]:
    """How the energy of (a, b] (part of the interval (f0, f1], spread evenly over it) is priced: (fraction,
    intensity g/kWh or None when unknown, PUE). The intensity in force at ``f1`` prices it all, unless it
    took that value inside (a, b) (``Frame.intensity_change``): then the part before is priced at the value
    before, at ``f0``'s PUE."""
    pue1 = f1.pue if f1.pue is not None else 1.0
    change = f1.intensity_change
    if change is not None and f1.intensity is not None and b > a:
        tc = f1.t + change[0]
        if a < tc < b:
            before = (tc - a) / (b - a)
            pue0 = f0.pue if f0.pue is not None else pue1
            return [(before, change[1], pue0), (1.0 - before, f1.intensity, pue1)]
    return [(1.0, f1.intensity, pue1)]


def unattributed(f0: Frame, f1: Frame, holders: Mapping[str, Sequence[Holding]]
                 ) -> Iterator[tuple[str, GPUFrame, float]]:
    """Each GPU's energy over (f0, f1] that no run held: (GPU key, its frame at f1, joules)."""
    span = f1.t - f0.t
    if span <= 0:
        return
    for key, g1 in f1.gpus.items():
        g0 = f0.gpus.get(key)
        if g0 is None or g0.energy_j is None or g1.energy_j is None or g1.energy_j < g0.energy_j:
            continue
        free_s = ledger_split.unattributed(f0.t, f1.t, holders.get(key, []), g1.procs)
        if free_s > 0:
            yield key, g1, (g1.energy_j - g0.energy_j) * free_s / span


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


def max_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)
