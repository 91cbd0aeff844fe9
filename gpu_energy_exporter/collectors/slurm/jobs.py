"""Per-job GPU energy: integrate each GPU's energy deltas to the Slurm jobs holding it.

Pure arithmetic, like ``kubernetes.attribution``: energy counters, times and the GPU -> job map come in
as arguments; this module never does I/O and never reads a clock.

How one GPU's energy delta between two updates is split (the ``method`` label, the same names as for
pods):

- ``exclusive``: one job holds the whole GPU: it gets all of the delta, idle power included.
- ``mig_slices``: jobs hold MIG instances of the GPU (files ``<index>.<gpu instance>``): the delta is
  split over the held instances by weight (their compute slices where known, else 1 each), and evenly
  between jobs listed on one instance. Whole-GPU energy is never repeated per instance.
- ``sm_utilization``: several jobs list the same whole GPU (shards, ``OverSubscribe``) and their
  processes' SM utilisation is known for the interval: split by it.
- ``shared_even``: shared as above without usable utilisation: split evenly.

Each interval is charged to the jobs that held the GPU at its start (the previous update's map), up to the
time the map changed (``cuts``: the GPU file's own modification time, ``slurm.edges``), and to the new map
after it: a job is charged from the prolog's write to the epilog's, not from the next sample. The exporter
reads the energy counters as soon as the directory changes (``slurm.watch``, and
``SlurmCollector.mapping_changed`` at each sample), so a job's edges fall a few milliseconds before counter
reads. Settled, not guessed (``core.settle.SpanBook``): the counters grow when a counter read settles the
span's pieces (the counter's exact delta spread by the power readings' shape, each piece split by the SM
samples of the jobs' processes over it); they lag by at most one counter interval, and the part not settled
yet is ``provisional``. A GPU no job holds adds to its unattributed counter, so that over any window in which
the map did not change ``sum(jobs) + unattributed == GPU energy``. A job that has held no GPU for ``grace_s``
loses its series (finished jobs expire, so the series count follows the running jobs, not the job history),
and at most ``MAX_JOBS`` jobs are kept: past it, those that held a GPU longest ago expire first (a directory
rewritten with new job ids at every sample cannot grow the series without bound within the grace period).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.core import sharing
from gpu_energy_exporter.core.settle import SpanBook, Split
from gpu_energy_exporter.core.state import GPUState

METHOD_EXCLUSIVE = "exclusive"
METHOD_MIG_SLICES = "mig_slices"
METHOD_SM_UTILIZATION = "sm_utilization"
METHOD_SHARED_EVEN = "shared_even"
#: Jobs kept at most (twice what one read of the mapping directory may hold: ``slurm.mapping.MAX_JOBS``).
MAX_JOBS = 2048
_METHOD = {sharing.RULE_EXCLUSIVE: METHOD_EXCLUSIVE, sharing.RULE_MIG: METHOD_MIG_SLICES,
           sharing.RULE_SM_UTIL: METHOD_SM_UTILIZATION, sharing.RULE_EVEN: METHOD_SHARED_EVEN}


@dataclass(frozen=True, order=True)
class JobSlot:
    """One job's hold on one physical GPU (``instance`` "" for the whole GPU, else the MIG instance's
    name in the mapping directory, ``<index>.<gpu instance>``)."""

    gpu_uuid: str
    job_id: str
    instance: str = ""
    weight: float = 1.0  # compute slices of the MIG instance (1 for a whole GPU or when unknown)


def split(
    delta_j: float, slots: Sequence[JobSlot], sm: Mapping[str, float] | None = None
) -> list[tuple[str, str, float]]:
    """Split one GPU's delta over its slots: [(job id, method, joules)], summing to ``delta_j``.
    ``sm``: job id -> summed SM utilisation of its processes on this GPU over the interval. The rule is
    ``core.sharing.split``, the one runs and pods use; this maps the job slots onto it."""
    members = [sharing.Member(s.job_id, s.instance, max(1, int(s.weight)),
                              None if sm is None or s.job_id not in sm else float(sm[s.job_id]))
               for s in sorted(slots, key=lambda s: (s.instance, s.job_id))]
    return [(job, _METHOD[rule], part) for job, rule, part in sharing.split(delta_j, members)]


#: A part's owner key in the book: (job id, method); ``UNATTRIBUTED`` is energy no job held.
Key = tuple[str, str]
UNATTRIBUTED: Key = ("", "")


def job_weights(pid_weights: Mapping[int, float], owners: Mapping[int, str]) -> dict[str, float] | None:
    """Per-process SM use (pid -> SM %) as per-job weights through ``owners`` (pid -> job id, for the
    listed processes found in a job holding the GPU); None when none of them has a figure."""
    w: dict[str, float] = defaultdict(float)
    seen = False
    for pid, job in owners.items():
        sm = pid_weights.get(pid)
        if sm is not None and math.isfinite(sm) and sm >= 0:
            w[job] += sm
            seen = True
    return dict(w) if seen else None


def splitter(slots: Sequence[JobSlot], sm: Mapping[str, float] | None = None,
             owners: Mapping[int, str] | None = None) -> Split[Key]:
    """``split`` of one piece of a GPU held by ``slots`` as the settlement book calls it: weighed by the
    per-process samples over the piece through ``owners`` (pid -> job), else by ``sm`` (the last weights)."""
    held = tuple(slots)
    jobs = {s.job_id for s in held}
    mine = {pid: job for pid, job in (owners or {}).items() if job in jobs}  # the processes of these holders

    def parts(joules: float, pid_weights: Mapping[int, float] | None) -> list[tuple[Key, float]]:
        if not held:
            return [(UNATTRIBUTED, joules)]
        w = sm
        if pid_weights is not None and mine:
            w = job_weights(pid_weights, mine)
        return [((job, method), j) for job, method, j in split(joules, held, w)]

    return parts


class JobEnergyAttributor:
    """Accumulates per-job energy counters from successive GPU energy readings. One owner (the slurm
    collector, on the sampler thread); not thread-safe."""

    def __init__(self, grace_s: float = 300.0) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self._grace_s = grace_s
        self._book: SpanBook[Key] = SpanBook()
        self._energy: dict[tuple[str, str], float] = {}
        self._last_held: dict[str, float] = {}
        self._first_held: dict[str, float] = {}
        self._gpus: dict[str, set[str]] = defaultdict(set)
        self._unattributed: dict[str, float] = {}
        self._held: Mapping[str, Sequence[JobSlot]] = {}  # the previous update's map: who held each GPU
        # GPU -> (a change's time after the last reading, the holders before it): carried to the next update
        self._carry: dict[str, tuple[float, tuple[JobSlot, ...]]] = {}

    def update(
        self,
        now: float,
        gpu_energy_j: Mapping[str, float],
        holdings: Mapping[str, Sequence[JobSlot]],
        sm: Mapping[str, Mapping[str, float]] | None = None,
        *,
        states: Mapping[str, GPUState] | None = None,
        cuts: Mapping[str, float] | None = None,
        owners: Mapping[str, Mapping[int, str]] | None = None,
    ) -> None:
        """Charge every GPU's energy since the previous update to the jobs that held it then (the map of the
        previous update) up to its cut, to ``holdings`` after it, and remember ``holdings`` for the next.

        ``gpu_energy_j``: GPU UUID -> monotonic counter (joules); a GPU missing from it is skipped and its
        next delta covers the gap; the first reading only sets the baseline; a counter that goes
        backwards is rebased without charging anything. ``sm``: GPU UUID -> job id -> SM utilisation (the
        last known). ``states``: GPU UUID -> its state (the reading's time and the span that settles);
        without one a delta is charged at once. ``cuts``: GPU UUID -> when its holders changed (the GPU
        readings' monotonic clock; without one, at the end of the interval). ``owners``: GPU UUID -> pid ->
        job id of the processes listed now (maps the per-process samples when the piece settles)."""
        for gpu_uuid, slots in holdings.items():
            for s in slots:
                self._last_held[s.job_id] = now
                self._first_held.setdefault(s.job_id, now)
                self._gpus[s.job_id].add(gpu_uuid)
        for gpu_uuid, energy in gpu_energy_j.items():
            before = tuple(self._held.get(gpu_uuid, ()))
            after = tuple(holdings.get(gpu_uuid, ()))
            state = (states or {}).get(gpu_uuid)
            t = state.read_at if state is not None else None
            w, o = (sm or {}).get(gpu_uuid), (owners or {}).get(gpu_uuid)
            segments: list[tuple[float, Split[Key]]] = [(math.inf, splitter(before, w, o))]
            carried = self._carry.pop(gpu_uuid, None)
            cut = (cuts or {}).get(gpu_uuid)
            if carried is not None:
                segments = [(carried[0], splitter(carried[1], w, o)), (math.inf, splitter(before, w, o))]
            elif cut is not None and t is not None and before != after:
                if cut >= t:  # changed after this reading (between the GPU's read and the directory's)
                    self._carry[gpu_uuid] = (cut, before)
                else:
                    segments = [(cut, splitter(before, w, o)), (math.inf, splitter(after, w, o))]
            self._unattributed.setdefault(gpu_uuid, 0.0)
            span = state.span if state is not None else None
            for (job, method), joules in self._book.update(gpu_uuid, t=t, energy_j=energy, span=span,
                                                          segments=segments).items():
                if (job, method) == UNATTRIBUTED:
                    self._unattributed[gpu_uuid] += joules
                elif job in self._last_held:  # (a job that expired before its last span settled: dropped)
                    self._energy[(job, method)] = self._energy.get((job, method), 0.0) + joules
        self._held = {gpu: tuple(slots) for gpu, slots in holdings.items()}
        self._expire(now)

    def _expire(self, now: float) -> None:
        gone = [job for job, t in self._last_held.items() if now - t > self._grace_s]
        if len(self._last_held) - len(gone) > MAX_JOBS:
            kept = sorted((t, job) for job, t in self._last_held.items() if now - t <= self._grace_s)
            gone += [job for _, job in kept[:len(kept) - MAX_JOBS]]
        for job in gone:
            del self._last_held[job]
            self._first_held.pop(job, None)
            self._gpus.pop(job, None)
            for key in [k for k in self._energy if k[0] == job]:
                del self._energy[key]

    def job_energy(self) -> dict[tuple[str, str], float]:
        """(job id, method) -> joules settled, for every job that has not expired."""
        return dict(self._energy)

    def job_provisional(self) -> dict[str, float]:
        """job id -> joules charged since its GPUs' last counter reads, not settled yet (the power readings'
        estimate, split by the last weights): replaced when the next read settles them."""
        out = dict.fromkeys(self._last_held, 0.0)
        for gpu in self._book.gpus():
            for (job, _), joules in self._book.provisional(gpu).items():
                if job in out:
                    out[job] += joules
        return out

    def unattributed_energy(self) -> dict[str, float]:
        """GPU UUID -> joules consumed while no job held the GPU."""
        return dict(self._unattributed)

    def jobs(self) -> dict[str, tuple[float, float, tuple[str, ...]]]:
        """job id -> (first time held, last time held, GPU UUIDs), for jobs that have not expired."""
        return {job: (self._first_held[job], t, tuple(sorted(self._gpus[job])))
                for job, t in self._last_held.items()}
