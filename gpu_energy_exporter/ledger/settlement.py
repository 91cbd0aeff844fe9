"""Settling the run ledger's snapshot history at each read of a GPU's energy counter.

Between two counter reads a frame's GPU energy is provisional: the counter's last total plus the power
readings since, scaled (``frames.gpu_frame``). When a frame brings a counter read that closes a span
(``SpanFrame.closed``), ``settle_gpu`` rewrites that GPU in every frame of the history inside the span: its
energy becomes the counter's exact delta spread by the power readings' shape (``core.settle.spread``), and
its processes' SM weights the per-process samples NVML gave over each frame's interval
(``core.settle.sample_weights``). The runs holding the GPU are then recounted from the span's start by the
ledger, so over every span they sum to the counter's delta, and a correction never lands on a run that was
not there (an estimate that ran ahead is taken back from the intervals it was given to, not from the next run).

Pure: takes the history and returns the rewritten frames; no lock, no clock, no I/O (the ledger holds its
lock and recounts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, MutableSequence
from dataclasses import replace

from gpu_energy_exporter.core.settle import sample_weights
from gpu_energy_exporter.core.state import ProcessSample
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.snapshot_frames import Frame, GPUFrame

#: Two instants on the frame clock closer than this are one (float noise of offsets and adds).
EPS_S = 1e-6


def anchor_time(frame: Frame, key: str) -> float | None:
    """When the counter read that ``frame``'s GPU ``key`` stands on was taken (frame clock), or None."""
    g = frame.gpus.get(key)
    if g is None or g.span is None:
        return None
    return frame.t + g.span.anchor_dt


def settle_gpu(history: MutableSequence[Frame], key: str) -> float | None:
    """Settle GPU ``key`` over the span its counter read in ``history[-1]`` closed: rewrite the frames inside
    it (energy by the power readings' shape, SM weights by the samples). Returns the span's start (the
    time from which runs holding the GPU must be recounted), or None when that frame closed no span."""
    if not history:
        return None
    last = history[-1]
    g = last.gpus.get(key)
    if g is None or g.span is None or g.span.closed is None or not g.settled:
        return None
    span = g.span
    assert span.closed is not None
    start_dt, start_j, raw_total, whole = span.closed
    start_t, end_t = last.t + start_dt, last.t + span.anchor_dt
    delta = span.anchor_j - start_j
    if end_t - start_t <= EPS_S or delta < 0:
        return None
    samples = tuple(ProcessSample(pid, sm, last.t + a, last.t + b) for pid, sm, a, b in span.samples)
    shaped = whole and raw_total > 0
    prev_t: float | None = None
    for i in range(len(history)):
        f = history[i]
        if f.t <= start_t + EPS_S:
            prev_t = f.t
            continue
        gf = f.gpus.get(key)
        if gf is None:
            prev_t = f.t
            continue
        if i == len(history) - 1:
            new = _weighed(gf, prev_t, f.t, samples)
        else:
            new = _weighed(_settled(gf, f.t, start_t, end_t, start_j, delta, raw_total, shaped), prev_t, f.t,
                           samples)
        if new is not gf:
            history[i] = replace(f, gpus={**f.gpus, key: new})
        prev_t = f.t
    return start_t


def _settled(g: GPUFrame, t: float, start_t: float, end_t: float, start_j: float, delta: float,
             raw_total: float, shaped: bool) -> GPUFrame:
    """One frame inside a span, its energy settled: the span's start plus the delta times the share of the
    span's shape (power readings x time) reached at ``t``; by time where the shape is not known."""
    if g.span is None or g.energy_j is None:
        return g
    same = abs(t + g.span.anchor_dt - start_t) <= 1e-3  # measured from this span's start
    if shaped and same:
        frac = g.span.raw_j / raw_total
    else:
        frac = (t - start_t) / (end_t - start_t)
    frac = min(1.0, max(0.0, frac))
    return replace(g, energy_j=start_j + delta * frac, settled=True)


def _weighed(g: GPUFrame, t0: float | None, t1: float, samples: tuple[ProcessSample, ...]) -> GPUFrame:
    """The frame's processes weighed by the samples over (t0, t1] (unchanged where none covers it)."""
    if t0 is None or not samples or not g.procs:
        return g
    weights = sample_weights(t0, t1, samples)
    if weights is None:
        return g
    return replace(g, procs=tuple(replace(p, sm=weights.get(p.pid, 0.0)) for p in g.procs))


def holding_since(active: Iterable[Run], key: str, start: float, frame: Frame) -> Iterator[str]:
    """The runs that hold GPU ``key`` and counted frames after ``start``: they are recounted from there."""
    for run in active:
        if not run.tentative and run.acc.t > start and key in run.parents(frame):
            yield run.run_id


def closable(run: Run, frame: Frame, anchors: Mapping[str, float], wait_s: float) -> bool:
    """Whether every GPU of ``run`` had its counter read at or after the run's end (``anchors``: GPU key -> its
    last read, frame clock), so its energy is settled; or ``wait_s`` passed since the end: the run then closes
    with what is known, the part after the GPU's last read the power readings' estimate, and a note says so."""
    e = run.e if run.e is not None else frame.t
    waiting = [k for k in run.parents(frame)
               if k in frame.gpus and frame.gpus[k].span is not None and anchors.get(k, -math.inf) < e - 1e-6]
    if not waiting:
        return True
    if frame.t - e < wait_s:
        return False
    note = (f"the energy counter of GPU(s) {', '.join(frame.gpus[k].uuid for k in waiting)} was not read "
            f"within {wait_s:g}s after the run's end: the energy after its last read is the power readings' "
            "estimate (provisional)")
    if note not in run.notes:
        run.notes.append(note)
    return True
