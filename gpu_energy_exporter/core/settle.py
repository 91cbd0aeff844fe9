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
from collections.abc import Sequence

from gpu_energy_exporter.core.state import ProcessSample

__all__ = ["fractions", "sample_weights", "spread"]


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
