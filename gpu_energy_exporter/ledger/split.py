"""How the run ledger splits one GPU's energy between the runs using it: pure arithmetic.

Plain values in, figures out: no clock, no I/O, no threads (``accounting.py`` uses it; tests/test_ledger_split.py
checks it on its own). The split of one instant is the pod attributor's rule, reused
(``kubernetes.attribution.split``), with runs in place of containers:

- ``exclusive``: one run uses the GPU: it is charged all of the GPU's energy, idle power included.
- ``mig``: the run's GPU ids are MIG instances of the GPU: the GPU's energy is split over the instances in
  use in proportion to their compute slices, then evenly between runs sharing one instance. Instances no
  run uses get nothing (the instances in use absorb the whole GPU, as for pods). The ledger does not know
  MIG profiles (NVML's MIG device identity carries none), so every instance weighs 1 (``Holding.slices``
  is the hook): exact when the GPU is split into instances of one profile, e.g. 7 x ``1g``.
- ``sm_util``: several runs share the whole GPU and each run's summed SM utilisation is known: split in
  proportion. The hook is ``weights``; the ledger passes none today (a point does not carry the trainer's
  pid, so per-process SM utilisation cannot be matched to a run), so shared GPUs are split evenly.
- ``even``: several runs share the whole GPU without usable weights: split evenly.

Over an interval between two counter readings, the runs using the GPU may change (one starts or ends
inside it). The energy is taken as spread evenly over the interval (the ledger's linear interpolation of
the counter), the interval is cut at every run's start and end, and each piece is split over the runs
active in it. Pieces with no run are the GPU's unattributed energy. So for every GPU and every interval
``sum(charged) + unattributed == delta``, and no run is ever charged more than the GPU used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.core.memo import remember
from gpu_energy_exporter.kubernetes.attribution import (
    METHOD_EXCLUSIVE,
    METHOD_MIG_SLICES,
    METHOD_SHARED_EVEN,
    METHOD_SM_UTILIZATION,
    PodRef,
    Slot,
    split,
)

SPLIT_EXCLUSIVE = "exclusive"
SPLIT_EVEN = "even"
SPLIT_SM_UTIL = "sm_util"
SPLIT_MIG = "mig"
SPLITS = (SPLIT_EXCLUSIVE, SPLIT_EVEN, SPLIT_SM_UTIL, SPLIT_MIG)

_FROM_POD_METHOD = {
    METHOD_EXCLUSIVE: SPLIT_EXCLUSIVE,
    METHOD_SHARED_EVEN: SPLIT_EVEN,
    METHOD_SM_UTILIZATION: SPLIT_SM_UTIL,
    METHOD_MIG_SLICES: SPLIT_MIG,
}

__all__ = ["SPLITS", "Charge", "Holding", "charge", "shares", "unattributed"]


@dataclass(frozen=True, slots=True)
class Holding:
    """One run using one physical GPU (or one MIG instance of it) from ``start`` to ``end``."""

    run_id: str
    start: float
    end: float = math.inf  # math.inf while the run goes on
    mig_uuid: str = ""  # "" when the run names the whole GPU
    slices: int = 1  # MIG compute slices of the instance (unknown to the ledger: 1)


@dataclass(frozen=True, slots=True)
class Charge:
    """What one run gets of one GPU's interval: ``share_s`` is the run's share integrated over time
    (seconds x fraction), so its energy is ``delta x share_s / span`` and its idle energy ``idle W x
    share_s``; ``splits`` names the rules used; ``sharers`` the other runs it shared the GPU with."""

    share_s: float
    splits: frozenset[str]
    sharers: frozenset[str]


def shares(holdings: Iterable[Holding], weights: Mapping[str, float] | None = None) -> dict[str, tuple[float, str]]:
    """Run id -> (fraction of the GPU's energy, split rule) at one instant; the holdings are the runs using
    the GPU then. The fractions sum to 1 when ``holdings`` is not empty. A run holding several instances
    of one GPU gets the sum of their parts."""
    if not weights:
        # The split depends only on the set of (run, instance, slices): the ledger asks the same question for
        # every GPU of every interval it counts (and recounts), so the answers are kept (bounded).
        key = frozenset((h.run_id, h.mig_uuid, h.slices) for h in holdings)
        cached = _SHARES_CACHE.get(key)
        if cached is None:
            cached = _shares(key, None)
            remember(_SHARES_CACHE, key, cached, _SHARES_CACHE_MAX)
        return dict(cached)
    return _shares(frozenset((h.run_id, h.mig_uuid, h.slices) for h in holdings), weights)


_SHARES_CACHE: dict[frozenset[tuple[str, str, int]], dict[str, tuple[float, str]]] = {}
_SHARES_CACHE_MAX = 4096


def _shares(key: frozenset[tuple[str, str, int]],
            weights: Mapping[str, float] | None) -> dict[str, tuple[float, str]]:
    slots = sorted({Slot(gpu_uuid="", pod=PodRef("", run, ""), mig_uuid=mig, slices=max(1, slices))
                    for run, mig, slices in key})
    pod_weights = {PodRef("", run, ""): w for run, w in (weights or {}).items()}
    out: dict[str, tuple[float, str]] = {}
    for pod, method, part in split(1.0, slots, pod_weights):
        frac, _ = out.get(pod.pod, (0.0, ""))
        out[pod.pod] = (frac + part, _FROM_POD_METHOD[method])
    return out


def _pieces(t0: float, t1: float, holdings: Sequence[Holding]) -> list[tuple[float, float, list[Holding]]]:
    """(t0, t1] cut at every holding's start and end: (a, b, holdings active throughout (a, b])."""
    cuts = {t0, t1}
    for h in holdings:
        for x in (h.start, h.end):
            if t0 < x < t1:
                cuts.add(x)
    edges = sorted(cuts)
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        active = [h for h in holdings if h.start <= a and h.end >= b]
        out.append((a, b, active))
    return out


def charge(run_id: str, t0: float, t1: float, lo: float, hi: float, holdings: Sequence[Holding],
           weights: Mapping[str, float] | None = None) -> Charge:
    """The part of the GPU's interval (t0, t1] within [lo, hi] that goes to ``run_id``."""
    share_s = 0.0
    splits: set[str] = set()
    sharers: set[str] = set()
    for a, b, active in _pieces(t0, t1, holdings):
        x, y = max(a, lo), min(b, hi)
        if y <= x:
            continue
        part = shares(active, weights)
        if run_id not in part:
            continue
        frac, rule = part[run_id]
        share_s += frac * (y - x)
        splits.add(rule)
        sharers.update(r for r in part if r != run_id)
    return Charge(share_s, frozenset(splits), frozenset(sharers))


def unattributed(t0: float, t1: float, holdings: Sequence[Holding]) -> float:
    """Seconds of (t0, t1] during which no run used the GPU (its energy then is unattributed)."""
    return sum(b - a for a, b, active in _pieces(t0, t1, holdings) if not active)
