"""How the run ledger splits one GPU's energy between the runs using it: pure arithmetic.

Plain values in, figures out: no clock, no I/O, no threads (``accounting.py`` uses it; tests/test_ledger_split.py
checks it on its own). The rule of one instant is ``core.sharing.split``, the splitter pods use too; this
module says who the members are.

Where the GPU's process list is known (NVML answered and the host's process table names the processes:
``procs`` is not None), the processes are the members: each process NVML lists on the GPU is one, weighed
by its measured SM utilisation, and owned by the run whose process it is (``Holding.pids``, matched by the
ledger from the pid, container and pid namespaces) or by nobody. So:

- ``sm_util``: several processes share the GPU and each one's SM use is known: split in proportion; a
  process that pushes nothing keeps its share, which stays the GPU's unattributed energy.
- ``exclusive`` / ``even``: one owner, or no usable weights (even per process).
- ``grace``: a run that names the GPU but none of whose processes NVML lists yet, within
  ``--runs.claim-grace`` of its start (CUDA takes a while to create its context): it shares, evenly with
  other such runs, only the part of the GPU no run's process uses. It can never take a confirmed run's part.
  (Alone on a GPU that lists no process at all, it takes the whole GPU under the name ``exclusive``.)
- after the grace period such a claim is *unconfirmed*: charged nothing, counted (``Charge.unconfirmed_s``).

On a MIG-partitioned GPU each process is placed on its instance (``Proc.unit``, with its compute slices): the
instances in use share the GPU by slices (``mig``), and each instance's part goes to the owners of the
processes on it. Where the process list is not known (NVML gave none, none of the listed pids is in the
exporter's view of ``/proc``: a container without the host's pid namespace, or runs name MIG instances and
the driver did not place the processes on instances), the claims alone decide, as before processes
were read: one run ``exclusive``, several ``even``, MIG instances ``mig`` by slices (``Charge.unverified_s``
says how long, and the run's notes say so).

Over an interval between two counter readings, the runs using the GPU may change (one starts or ends
inside it, or its grace ends). The energy is taken as spread evenly over the interval (the ledger's linear
interpolation of the counter), the interval is cut at every such moment, and each piece is split over the
members active in it. What no run gets is the GPU's unattributed energy. So for every GPU and every interval
``sum(charged) + unattributed == delta``, and no run is ever charged more than the GPU used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.core import sharing
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.core.procinfo import ProcessIdentity

SPLIT_EXCLUSIVE = sharing.RULE_EXCLUSIVE
SPLIT_EVEN = sharing.RULE_EVEN
SPLIT_SM_UTIL = sharing.RULE_SM_UTIL
SPLIT_MIG = sharing.RULE_MIG
SPLIT_GRACE = "grace"
SPLITS = (SPLIT_EXCLUSIVE, SPLIT_EVEN, SPLIT_SM_UTIL, SPLIT_MIG, SPLIT_GRACE)

#: Why a run's claim on a GPU was not charged (the ``reason`` label of the unconfirmed-claims counter).
UNCONFIRMED_NO_PROCESS = "no_process"  # the run sent its pid, NVML lists none of its processes on the GPU
UNCONFIRMED_NO_PID = "no_pid"  # the run never said which process it is (no process.pid in its resource)
UNCONFIRMED_REASONS = (UNCONFIRMED_NO_PROCESS, UNCONFIRMED_NO_PID)


@dataclass(frozen=True, slots=True)
class Proc:
    """One process NVML lists on a GPU: its host pid, measured SM use (None: not measured) and what the
    host's /proc says about it (None: not found there)."""

    pid: int
    sm: float | None = None
    host: ProcessIdentity | None = None
    unit: str = ""  # the MIG instance (uuid key) it runs on, "" for the whole GPU
    slices: int = 1  # that instance's compute slices


__all__ = ["SPLITS", "Charge", "Holding", "Proc", "charge", "piece_shares", "shares", "unattributed"]


@dataclass(frozen=True, slots=True)
class Holding:
    """One run using one physical GPU (or one MIG instance of it) from ``start`` to ``end``.

    ``pids``: the host pids NVML lists on the GPU that are the run's own (matched by the ledger in the frame
    the holding was built for); ``grace_end``: until when the claim may go unconfirmed; ``has_pid``: whether
    the run said which processes it is at all."""

    run_id: str
    start: float
    end: float = math.inf  # math.inf while the run goes on
    mig_uuid: str = ""  # "" when the run names the whole GPU
    slices: int = 1  # MIG compute slices of the instance (unknown to the ledger: 1)
    pids: frozenset[int] = frozenset()
    grace_end: float = math.inf
    has_pid: bool = False
    #: a Slurm allocation gives the run this GPU (``ledger.jobs``): its claim is confirmed whatever NVML lists
    allocated: bool = False


@dataclass(frozen=True, slots=True)
class Charge:
    """What one run gets of one GPU's interval: ``share_s`` is the run's share integrated over time
    (seconds x fraction), so its energy is ``delta x share_s / span`` and its idle energy ``idle W x
    share_s``; ``splits`` names the rules used; ``sharers`` the other runs it shared the GPU with;
    ``unconfirmed_s`` the seconds its claim went unconfirmed after the grace period (charged nothing, for
    ``reason``); ``unverified_s`` the seconds it was charged on its claim alone (no process list)."""

    share_s: float
    splits: frozenset[str]
    sharers: frozenset[str]
    unconfirmed_s: float = 0.0
    reason: str = ""
    unverified_s: float = 0.0
    silent: frozenset[int] = frozenset()  # pids of processes that are no run's, sharing the GPU with it


def shares(holdings: Iterable[Holding], weights: Mapping[str, float] | None = None) -> dict[str, tuple[float, str]]:
    """Run id -> (fraction of the GPU's energy, split rule) at one instant, by the claims alone (no process
    list); the holdings are the runs using the GPU then. The fractions sum to 1 when ``holdings`` is not
    empty. A run holding several instances of one GPU gets the sum of their parts."""
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
    members = [sharing.Member(run, mig, max(1, slices), None if weights is None else weights.get(run, 0.0))
               for run, mig, slices in sorted(key)]
    out: dict[str, tuple[float, str]] = {}
    for run, rule, part in sharing.split(1.0, members):
        frac, _ = out.get(run, (0.0, ""))
        out[run] = (frac + part, rule)
    return out


def piece_shares(active: Sequence[Holding], procs: Sequence[Proc] | None, at: float) -> dict[str, tuple[float, str]]:
    """Run id -> (fraction, rule) at time ``at`` (the start of a piece), given the runs active then and the
    processes NVML lists on the GPU (None: not known, the claims alone decide). Fractions sum to at most 1;
    the rest is the GPU's unattributed energy."""
    if not active:
        return {}
    if not by_process(active, procs):
        return shares(active)  # no process list (or MIG processes not placed on instances): the claims
    assert procs is not None
    owner: dict[int, str] = {}
    for h in active:
        for pid in h.pids:
            owner.setdefault(pid, h.run_id)
    members = [sharing.Member(owner.get(p.pid, f"\0pid {p.pid}"), p.unit, p.slices, p.sm) for p in procs]
    out: dict[str, tuple[float, str]] = {}
    stray: list[tuple[str, str, float]] = []  # (MIG instance, rule, part) of each process that is no run's
    units = {f"\0pid {p.pid}": p.unit for p in procs}
    for who, rule, part in sharing.split(1.0, members):
        if who.startswith("\0"):
            stray.append((units.get(who, ""), rule, part))  # the GPU's unattributed energy, or an allocation's
            continue
        frac, _ = out.get(who, (0.0, ""))
        out[who] = (frac + part, rule)
    allocated = _allocated(active, stray, out)
    if allocated:
        return allocated
    confirmed = set(owner.values())
    waiting = sorted({h.run_id for h in active if h.run_id not in confirmed and at < h.grace_end})
    free = 1.0 - sum(f for f, _ in out.values())
    if waiting and free > 1e-12:
        # Alone on a GPU where no process is listed yet (CUDA starting, or its process just exited before
        # its finish point): the whole GPU, as a lone claim always was (``exclusive``, so the split label
        # of a run does not change at every start and end); anything else is ``grace``.
        alone = len(waiting) == 1 and not procs and not out
        for run in waiting:
            out[run] = (free / len(waiting), SPLIT_EXCLUSIVE if alone else SPLIT_GRACE)
    return out


def _allocated(active: Sequence[Holding], stray: Sequence[tuple[str, str, float]],
               out: dict[str, tuple[float, str]]) -> dict[str, tuple[float, str]] | None:
    """The split where Slurm jobs hold the GPU (or an instance of it): Slurm gave it to them, so the
    processes that are no run's there are theirs (a job needs no helper), and so is the whole GPU when no
    process is listed; runs' own processes keep their measured share. ``stray``: (MIG instance, split rule,
    part) of the processes that are no run's. None when no job holds the GPU."""
    units = {h.run_id: h.mig_uuid for h in active if h.allocated}
    if not units:
        return None
    jobs = sorted(units)
    res = dict(out)
    parts: dict[str, tuple[float, str]] = {}
    if not out and not stray:  # nothing listed: the jobs' allocations alone
        parts = {j: (1.0 / len(jobs), SPLIT_EXCLUSIVE if len(jobs) == 1 else SPLIT_EVEN) for j in jobs}
    for unit, rule, part in stray:  # to the jobs holding the process's instance (or the whole GPU), evenly
        mine = [j for j in jobs if units[j] in ("", unit)]  # none: an instance no job holds, unattributed
        for j in mine:
            parts[j] = (parts.get(j, (0.0, rule))[0] + part / len(mine), rule)
    for j, (part, rule) in parts.items():
        frac, had = res.get(j, (0.0, ""))
        res[j] = (frac + part, had or rule)
    return res


def by_process(active: Sequence[Holding], procs: Sequence[Proc] | None) -> bool:
    """Whether the processes decide the split (else the claims): the list is known and, where runs name MIG
    instances, every listed process is placed on its instance."""
    return procs is not None and (not any(h.mig_uuid for h in active) or all(p.unit for p in procs))


def _pieces(t0: float, t1: float, holdings: Sequence[Holding]) -> list[tuple[float, float, list[Holding]]]:
    """(t0, t1] cut at every holding's start, end and grace end: (a, b, holdings active throughout (a, b])."""
    cuts = {t0, t1}
    for h in holdings:
        for x in (h.start, h.end, h.grace_end):
            if t0 < x < t1:
                cuts.add(x)
    edges = sorted(cuts)
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        active = [h for h in holdings if h.start <= a and h.end >= b]
        out.append((a, b, active))
    return out


def charge(run_id: str, t0: float, t1: float, lo: float, hi: float, holdings: Sequence[Holding],
           procs: Sequence[Proc] | None = None) -> Charge:
    """The part of the GPU's interval (t0, t1] within [lo, hi] that goes to ``run_id``; ``procs``: the
    processes NVML listed on the GPU at t1 (None: not known)."""
    share_s = unconfirmed_s = unverified_s = 0.0
    reason = ""
    splits: set[str] = set()
    sharers: set[str] = set()
    silent: set[int] = set()
    for a, b, active in _pieces(t0, t1, holdings):
        x, y = max(a, lo), min(b, hi)
        if y <= x:
            continue
        part = piece_shares(active, procs, a)
        if run_id not in part:
            mine = next((h for h in active if h.run_id == run_id), None)
            if (mine is not None and by_process(active, procs) and not mine.pids and a >= mine.grace_end
                    and not mine.allocated):
                unconfirmed_s += y - x
                reason = UNCONFIRMED_NO_PROCESS if mine.has_pid else UNCONFIRMED_NO_PID
            continue
        frac, rule = part[run_id]
        share_s += frac * (y - x)
        if not by_process(active, procs):
            unverified_s += y - x
        splits.add(rule)
        sharers.update(r for r in part if r != run_id)
        if procs is not None:
            owned = {pid for h in active for pid in h.pids}
            silent.update(p.pid for p in procs if p.pid not in owned)
    return Charge(share_s, frozenset(splits), frozenset(sharers), unconfirmed_s, reason, unverified_s,
                  frozenset(silent))


def unattributed(t0: float, t1: float, holdings: Sequence[Holding], procs: Sequence[Proc] | None = None) -> float:
    """Seconds x fraction of (t0, t1] that no run was charged (its energy then is the GPU's unattributed)."""
    total = 0.0
    for a, b, active in _pieces(t0, t1, holdings):
        charged = sum(f for f, _ in piece_shares(active, procs, a).values())
        total += (b - a) * max(0.0, 1.0 - charged)
    return total
