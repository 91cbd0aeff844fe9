"""Energy accounting of one run over one snapshot interval: pure arithmetic on plain values.

``integrate`` adds the part of a snapshot interval (f0, f1] that lies in a run's [lo, hi] to the run's
accumulator ``Acc``: each GPU's energy counter delta times the run's share of the GPU (``ledger.split``),
idle energy, GPU-time with and without a counter, VRAM, peak power and CO2, each by its rule in ``billing``
(this module applies them to frames and adds the results up). ``Acc`` holds only plain
values so it can be copied as a checkpoint; ``Timeline`` is the bounded per-run series behind the reports.

Like ``kubernetes/attribution.py`` and ``ledger/split.py``, this module takes frames and holdings and
returns numbers: no locks, no threads, no I/O, no clock. It never integrates power into energy (power only
bounds the peak) and never reads a GPU reading: frames (``ledger.snapshot_frames``) carry base units.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_energy_exporter.ledger import billing
from gpu_energy_exporter.ledger import split as ledger_split
from gpu_energy_exporter.ledger.billing import max_opt
from gpu_energy_exporter.ledger.snapshot_frames import Frame, GPUFrame
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
    cut = billing.interval_cut(f0.t, f1.t, lo, hi, window_start)
    if cut is None:
        return None
    seg = Segment([], set(), set(), None, lo < f1.t <= hi)
    read = _Readings()
    for key in keys:
        g1 = f1.gpus.get(key)
        if g1 is None:
            continue  # not a GPU of this node: its energy is another exporter's
        acc.expected_gpu_s += cut.overlap
        seg.gpus.append((key, g1))
        hs = holders.get(key, [])
        share = ledger_split.charge(run_id, f0.t, f1.t, cut.a, cut.b, hs, g1.procs)
        win_share_s = ledger_split.charge(run_id, f0.t, f1.t, cut.wa, cut.b, hs, g1.procs).share_s \
            if cut.window > 0 else 0.0
        _add_claims(acc, seg, key, share)
        _add_energy(acc, read, key, f0.gpus.get(key), g1, cut, share.share_s, win_share_s)
        _add_idle(acc, key, g1.idle_w, share.share_s, win_share_s)
        read.add(g1, run_id, hs, f1.t)
    if read.vram_sum is not None:
        acc.vram_byte_s += billing.per_gpu_byte_s(read.vram_sum, read.vram_n, cut.overlap)
        acc.vram_s += cut.overlap
    seg.vram_sum = read.vram_sum
    # A snapshot's instantaneous values belong to the run only if it was taken inside the run.
    acc.peak_power_w = billing.interval_peak_w(acc.peak_power_w, read.joules, cut.overlap, read.power_sum,
                                               every_counter_read=read.every_counter_read, inside=seg.inside)
    if seg.inside and read.vram_max is not None:
        acc.vram_peak = max_opt(acc.vram_peak, read.vram_max)
    _add_carbon(acc, f0, f1, cut, read.joules)
    return seg


@dataclass(slots=True)
class _Readings:
    """What one interval's GPUs added up to, for the run (``integrate``)."""

    joules: float = 0.0  # charged to the run
    every_counter_read: bool = True  # every GPU of the run had a counter delta
    power_sum: float | None = None  # the run's share of its GPUs' power at f1
    vram_sum: float | None = None  # memory used at f1, summed over its GPUs
    vram_max: float | None = None
    vram_n: int = 0

    def add(self, g1: GPUFrame, run_id: str, holdings: Sequence[Holding], t1: float) -> None:
        """``g1``'s power (the run's share of it at ``t1``, among the runs holding the GPU then) and memory."""
        if g1.power_w is not None:
            now = [h for h in holdings if h.start <= t1 <= h.end]
            now_share = ledger_split.piece_shares(now, g1.procs, t1)
            self.power_sum = (self.power_sum or 0.0) + g1.power_w * now_share.get(run_id, (0.0, ""))[0]
        if g1.memory_used is not None:
            self.vram_sum = (self.vram_sum or 0.0) + g1.memory_used
            self.vram_max = max_opt(self.vram_max, float(g1.memory_used))
            self.vram_n += 1


def _add_claims(acc: Acc, seg: Segment, key: str, share: ledger_split.Charge) -> None:
    """What the split said about the run's claim on GPU ``key``: rules, sharers, unconfirmed, unverified."""
    seg.splits |= share.splits
    seg.sharers |= share.sharers
    if share.unconfirmed_s > 0:
        acc.unconfirmed_s[key] = acc.unconfirmed_s.get(key, 0.0) + share.unconfirmed_s
        seg.unconfirmed[key] = share.reason
    seg.silent |= share.silent
    if share.unverified_s > 0:
        acc.unverified_s[key] = acc.unverified_s.get(key, 0.0) + share.unverified_s


def _add_energy(acc: Acc, read: _Readings, key: str, g0: GPUFrame | None, g1: GPUFrame, cut: billing.Cut,
                share_s: float, win_share_s: float) -> None:
    """The run's energy of GPU ``key`` over the cut, or GPU-time without energy when its counter was not read."""
    delta = billing.counter_delta_j(g0.energy_j if g0 is not None else None, g1.energy_j)
    if delta is None:
        read.every_counter_read = False
        return
    joules = billing.charged_j(delta, share_s, cut.span)
    acc.energy_j += joules
    acc.win_energy_j += billing.charged_j(delta, win_share_s, cut.span)
    acc.per_gpu_j[key] = acc.per_gpu_j.get(key, 0.0) + joules
    acc.measured_gpu_s += cut.overlap
    read.joules += joules


def _add_idle(acc: Acc, key: str, idle_w: float | None, share_s: float, win_share_s: float) -> None:
    """The run's idle energy of GPU ``key``; while its idle power is not known, the share-seconds to price
    once it is (``billing.idle_total``)."""
    if idle_w is not None:
        acc.idle_j += billing.idle_j(idle_w, share_s)
        acc.win_idle_j += billing.idle_j(idle_w, win_share_s)
    else:
        acc.idle_unknown_s[key] = acc.idle_unknown_s.get(key, 0.0) + share_s
        acc.win_idle_unknown_s[key] = acc.win_idle_unknown_s.get(key, 0.0) + win_share_s


def _add_carbon(acc: Acc, f0: Frame, f1: Frame, cut: billing.Cut, joules: float) -> None:
    """The CO2 of the run's energy over the cut, priced at the intensity and PUE in force (``billing``)."""
    change = f1.intensity_change
    change_at = f1.t + change[0] if change is not None else None
    before = billing.Grid(change[1] if change is not None else None, f0.pue)
    for piece in billing.carbon_pieces(joules, cut.a, cut.b, billing.Grid(f1.intensity, f1.pue), before, change_at):
        if piece.intensity is None:
            acc.carbon_missing_kwh += piece.kwh
            continue
        acc.co2_g += piece.co2_g
        acc.carbon_kwh += piece.kwh
        acc.carbon_weighted_intensity += piece.kwh * piece.intensity
        acc.carbon_weighted_pue += piece.kwh * piece.pue


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
