"""Settlement: what a GPU really used between two reads of its energy counter, and who used it.

Between two counter reads every figure is provisional (the power readings' estimate). At the read the span
is settled: the counter's exact delta is spread over the span by the power samples' shape (``spread``), and
each piece is split by the members active then, weighed by the per-process SM use NVML reported over that
piece (``sample_weights``). Every consumer of a GPU's energy (the run ledger, pods, Slurm jobs) settles
with these functions; the rule that splits one piece between members is ``core.sharing.split``.

Pure arithmetic on plain values (joules, seconds on one monotonic clock, SM percent): no I/O, no clock, no
NVML, nothing of the package but ``core.state``'s value types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpu_energy_exporter.core.state import EnergySpan, ProcessSample

__all__ = ["SpanBook", "Split", "fractions", "sample_weights", "spread"]

K = TypeVar("K", bound=Hashable)  # a consumer's owner key: (container, method), (job id, method), ...


def spread(delta_j: float, shape_j: Sequence[float], durations_s: Sequence[float], *,
           shaped: bool = True) -> list[float]:
    """``delta_j`` (the counter's delta over a span) spread over the span's pieces: in proportion to each
    piece's estimated energy ``shape_j`` (power readings x time, any scale) when ``shaped`` and the shape
    sums above zero, else in proportion to the pieces' ``durations_s`` (the shape is not known: a gap
    without power readings). The parts sum to ``delta_j`` (the last part takes the rounding)."""
    if len(shape_j) != len(durations_s):
        raise ValueError("one shape value per piece")
    if not durations_s:
        return []
    weights = [max(0.0, w) if math.isfinite(w) else 0.0 for w in shape_j] if shaped else []
    if not weights or sum(weights) <= 0:
        weights = [max(0.0, d) for d in durations_s]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(durations_s), float(len(durations_s))
    parts = [delta_j * w / total for w in weights]
    parts[-1] = delta_j - sum(parts[:-1])
    return parts


def fractions(shape_j: Sequence[float], durations_s: Sequence[float], *, shaped: bool = True) -> list[float]:
    """The cumulative fraction of a span's energy reached at the end of each piece (``spread`` of 1.0,
    summed): 1.0 at the last piece."""
    out: list[float] = []
    acc = 0.0
    for part in spread(1.0, shape_j, durations_s, shaped=shaped):
        acc += part
        out.append(acc)
    if out:
        out[-1] = 1.0
    return out


def sample_weights(t0: float, t1: float, samples: Sequence[ProcessSample]) -> dict[int, float] | None:
    """Each process's SM use over (t0, t1]: the time-weighted mean of the samples that cover part of it
    (a sample covers (start, end]: the driver's per-process figure is a mean over the time since the read
    before). Only processes with a covering sample are in the answer; a listed process without one used no
    SMs then (NVML reports a process only when it used them), so callers weigh it 0. None when no sample
    covers the piece at all: the weights are not known then (the caller falls back to the last ones known)."""
    if t1 <= t0:
        return None
    num: dict[int, float] = {}
    den: dict[int, float] = {}
    for s in samples:
        a, b = max(t0, s.start), min(t1, s.end)
        if b <= a and not (s.end == s.start and t0 < s.end <= t1):
            continue
        w = b - a if b > a else 1e-9  # an instant sample inside the piece weighs, but barely
        if not (math.isfinite(s.sm_pct) and s.sm_pct >= 0):
            continue
        num[s.pid] = num.get(s.pid, 0.0) + s.sm_pct * w
        den[s.pid] = den.get(s.pid, 0.0) + w
    if not den:
        return None
    return {pid: num[pid] / den[pid] for pid in den}


# ---- settling a consumer's counters piece by piece (pods, Slurm jobs) ------------------------------------

#: Splits one piece's energy between owners: ``split(joules, pid_weights)`` -> (owner key, joules) parts that
#: sum to ``joules``. ``pid_weights``: each process's SM use over the piece (``sample_weights``), or the last
#: weights known when no sample covers it, or None when none are known at all (the splitter's even rule).
Split = Callable[[float, "Mapping[int, float] | None"], Iterable[tuple[K, float]]]

#: Two instants of one monotonic clock closer than this are one.
EPS_S = 1e-6
#: Pending pieces kept per GPU (an hour of 1 s samples): a span longer than that is charged as estimated.
MAX_PIECES = 4096


@dataclass(slots=True)
class _Piece(Generic[K]):
    """One sample's interval (``t0``, ``t1``] (or a part of it, cut at an edge) of an open span."""

    t0: float
    t1: float
    raw_j: float  # the power readings' estimate over it (the span's shape), unscaled
    split: Split[K] | None  # None: energy before the book's first sample (charged to nobody here)
    weights: Mapping[int, float] | None  # the last per-process weights known at the sample (provisional)


@dataclass(slots=True)
class _Open(Generic[K]):
    """A GPU's open span as the book holds it."""

    t: float | None = None  # the last sample's time (``GPUState.read_at``)
    energy_j: float | None = None  # its energy (what a GPU without a span settles at once)
    anchor_at: float | None = None  # the open span's counter read
    raw_j: float = 0.0  # ``EnergySpan.raw_j`` at the last sample
    pieces: list[_Piece[K]] = field(default_factory=list)
    provisional: dict[K, float] = field(default_factory=dict)


class SpanBook(Generic[K]):
    """Per GPU, the pieces of the span since its last energy-counter read, for a consumer that keeps settled
    counters (pods, Slurm jobs): each sample adds its interval, split between the owners then (``Split``);
    the sample whose read closes the span (``EnergySpan.closed``) settles every pending piece with the
    counter's exact delta, spread by the power readings' shape (``spread``; by time where the shape is not
    whole) and split by the samples NVML gave over each piece (``sample_weights``). Between reads the
    pending pieces' provisional parts (the power readings' estimate, scaled, split by the last weights) are
    kept apart (``provisional``): they are replaced at the read, never added to the settled counters, so over
    every span the settled parts sum to the counter's delta.

    A GPU state without a span (no energy counter: integrated power; or a state a test built) settles each
    sample's energy delta at once. Not thread-safe: one owner (a collector, on the sampler thread)."""

    def __init__(self) -> None:
        self._gpus: dict[str, _Open[K]] = {}

    def update(self, gpu: str, *, t: float | None, energy_j: float | None, span: EnergySpan | None,
               segments: Sequence[tuple[float, Split[K]]], weights: Mapping[int, float] | None = None
               ) -> dict[K, float]:
        """One sample of GPU ``gpu`` (``t``: ``GPUState.read_at``, ``energy_j`` and ``span`` its state's):
        the interval since the book's last sample of it is split by ``segments`` (who held the GPU until
        when: [(end, split), ...], in time order, the last one running to ``t``; a GPU without times takes the
        first segment's split for the whole delta) with ``weights`` (pid -> SM %, the last known; None:
        not known). Returns the energy settled by this sample, per owner key (to add to the counters)."""
        g = self._gpus.setdefault(gpu, _Open())
        if span is None or t is None:
            return self._at_once(g, t, energy_j, segments, weights)
        settled: dict[K, float] = {}
        if g.t is not None and t <= g.t + EPS_S:
            return settled  # no new reading (the GPU did not answer; its last state is carried on)
        closed = span.closed
        if g.anchor_at is None or g.t is None:
            if g.energy_j is not None and energy_j is not None:
                # From energy settled at once to a span (the counter's first read): the delta up to now is
                # settled as before; the span's part before this sample was in it.
                _add(settled, self._at_once(g, t, energy_j, segments, weights))
            self._open(g, t, energy_j, span)
            return settled
        if closed is not None and abs(closed[0] - g.anchor_at) <= EPS_S:
            self._cut(g, t, closed[2] - g.raw_j, segments, weights, span.scale)
            _add(settled, self._settle(g, span.anchor_j - closed[1], closed[2], closed[3], span.samples))
            g.t, g.energy_j, g.anchor_at, g.raw_j = t, energy_j, span.anchor_at, span.raw_j
            return settled
        if abs(span.anchor_at - g.anchor_at) <= EPS_S:
            self._cut(g, t, span.raw_j - g.raw_j, segments, weights, span.scale)
            g.t, g.energy_j, g.raw_j = t, energy_j, span.raw_j
            if len(g.pieces) > MAX_PIECES:
                # A counter that cannot be read for an hour: what is pending is charged as estimated (bounded
                # memory); the read that closes the span settles only what follows.
                _add(settled, self._flush(g))
                g.pieces.append(_Piece(span.anchor_at, t, max(0.0, span.raw_j), None, None))
            return settled
        # The span moved on without a read this book saw closing it (a sample missed, a counter restart):
        # what is pending is charged as estimated (all that is known of it), and a new span opens here.
        _add(settled, self._flush(g))
        self._open(g, t, energy_j, span)
        return settled

    def provisional(self, gpu: str) -> dict[K, float]:
        """The provisional parts of GPU ``gpu``'s open span (not settled yet), per owner key."""
        g = self._gpus.get(gpu)
        return dict(g.provisional) if g is not None else {}

    def gpus(self) -> list[str]:
        return list(self._gpus)

    # ---- internals

    def _open(self, g: _Open[K], t: float, energy_j: float | None, span: EnergySpan) -> None:
        """Start following ``span`` at ``t``: its part before ``t`` is a piece nobody here is charged for."""
        g.pieces, g.provisional = [], {}
        g.t, g.energy_j, g.anchor_at, g.raw_j = t, energy_j, span.anchor_at, span.raw_j
        if t > span.anchor_at + EPS_S:
            g.pieces.append(_Piece(span.anchor_at, t, max(0.0, span.raw_j), None, None))

    def _cut(self, g: _Open[K], t: float, raw_j: float, segments: Sequence[tuple[float, Split[K]]],
             weights: Mapping[int, float] | None, scale: float) -> None:
        """The interval (g.t, t] as pieces, one per segment it meets, its shape shared by time between them;
        their provisional parts added."""
        assert g.t is not None
        t0, raw_j = g.t, max(0.0, raw_j)
        for a, b, split in _segments(t0, t, segments):
            piece = _Piece(a, b, raw_j * (b - a) / (t - t0), split, weights)
            g.pieces.append(piece)
            _add(g.provisional, split(scale * piece.raw_j, weights))

    def _settle(self, g: _Open[K], delta_j: float, raw_total: float, whole: bool,
                samples: Sequence[ProcessSample]) -> dict[K, float]:
        pieces, g.pieces, g.provisional = g.pieces, [], {}
        out: dict[K, float] = {}
        if not pieces or not delta_j >= 0.0:
            return out
        parts = spread(delta_j, [p.raw_j for p in pieces], [p.t1 - p.t0 for p in pieces],
                       shaped=whole and raw_total > 0)
        for p, joules in zip(pieces, parts, strict=True):
            if p.split is None:
                continue
            measured = sample_weights(p.t0, p.t1, samples) if samples else None
            _add(out, p.split(joules, measured if measured is not None else p.weights))
        return out

    def _flush(self, g: _Open[K]) -> dict[K, float]:
        out, g.pieces, g.provisional = g.provisional, [], {}
        return out

    def _at_once(self, g: _Open[K], t: float | None, energy_j: float | None,
                 segments: Sequence[tuple[float, Split[K]]], weights: Mapping[int, float] | None) -> dict[K, float]:
        """A GPU without a span: the energy since its last sample, split now (the pending pieces of a span it
        had are charged as estimated)."""
        out = self._flush(g) if g.pieces else {}
        last, last_t = g.energy_j, g.t
        g.anchor_at, g.raw_j = None, 0.0
        if energy_j is None:
            return out  # not sampled: the next delta covers the gap
        g.energy_j = energy_j
        if t is not None:
            g.t = t
        if last is None or energy_j < last or not segments:
            return out  # the baseline; or a counter that went back: rebased, nothing charged
        delta = energy_j - last
        if t is None or last_t is None or t <= last_t:
            _add(out, segments[0][1](delta, weights))
            return out
        for a, b, split in _segments(last_t, t, segments):
            _add(out, split(delta * (b - a) / (t - last_t), weights))
        return out


def _segments(t0: float, t1: float, segments: Sequence[tuple[float, Split[K]]]) -> list[tuple[float, float, Split[K]]]:
    """(t0, t1] cut at the segments' ends: [(a, b, split)], none empty, covering it (the last segment runs to
    ``t1``; an end outside (t0, t1) cuts nothing)."""
    out: list[tuple[float, float, Split[K]]] = []
    lo = t0
    for i, (end, split) in enumerate(segments):
        hi = t1 if i == len(segments) - 1 else min(max(end, lo), t1)
        if hi > lo:
            out.append((lo, hi, split))
            lo = hi
    return out


def _add(into: dict[K, float], parts: Iterable[tuple[K, float]] | Mapping[K, float]) -> None:
    items = parts.items() if isinstance(parts, Mapping) else parts
    for key, joules in items:
        into[key] = into.get(key, 0.0) + joules
