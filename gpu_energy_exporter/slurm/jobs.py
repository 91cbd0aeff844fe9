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

Each interval is charged to the jobs that held the GPU at its start (the previous update's map): the
sample that first lists a job, and the first that no longer does, are where its energy starts and stops,
and the exporter reads the energy counters at exactly those samples (``GPUCollector.add_counter_read_check``
with ``SlurmCollector.mapping_changed``), so a job's edges are counter reads (docs/slurm.md, "Limits", says
what the energy apportioned between reads can still cost a job that stops dead). A GPU no job holds adds
to its unattributed counter, so that over any window in which the map did not
change ``sum(jobs) + unattributed == GPU energy``. A job that has held no GPU for ``grace_s`` loses its
series (finished jobs expire, so the series count follows the running jobs, not the job history), and at
most ``MAX_JOBS`` jobs are kept: past it, those that held a GPU longest ago expire first (a directory
rewritten with new job ids at every sample cannot grow the series without bound within the grace period).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.core import sharing

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


class JobEnergyAttributor:
    """Accumulates per-job energy counters from successive GPU energy readings. One owner (the slurm
    collector, on the sampler thread); not thread-safe."""

    def __init__(self, grace_s: float = 300.0) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self._grace_s = grace_s
        self._last_energy: dict[str, float] = {}
        self._energy: dict[tuple[str, str], float] = {}
        self._last_held: dict[str, float] = {}
        self._first_held: dict[str, float] = {}
        self._gpus: dict[str, set[str]] = defaultdict(set)
        self._unattributed: dict[str, float] = {}
        self._held: Mapping[str, Sequence[JobSlot]] = {}  # the previous update's map: who held each GPU

    def update(
        self,
        now: float,
        gpu_energy_j: Mapping[str, float],
        holdings: Mapping[str, Sequence[JobSlot]],
        sm: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """Charge every GPU's energy since the previous update to the jobs that held it then (the map of the
        previous update), and remember ``holdings`` for the next.

        ``gpu_energy_j``: GPU UUID -> monotonic counter (joules); a GPU missing from it is skipped and its
        next delta covers the gap; the first reading only sets the baseline; a counter that goes
        backwards is rebased without charging anything. ``sm``: GPU UUID -> job id -> SM utilisation."""
        for gpu_uuid, slots in holdings.items():
            for s in slots:
                self._last_held[s.job_id] = now
                self._first_held.setdefault(s.job_id, now)
                self._gpus[s.job_id].add(gpu_uuid)
        for gpu_uuid, energy in gpu_energy_j.items():
            last = self._last_energy.get(gpu_uuid)
            self._last_energy[gpu_uuid] = energy
            delta = 0.0 if last is None or energy < last else energy - last
            slots = self._held.get(gpu_uuid, ())
            unattributed = self._unattributed.setdefault(gpu_uuid, 0.0)
            if not slots:
                self._unattributed[gpu_uuid] = unattributed + delta
                continue
            for job, method, joules in split(delta, slots, (sm or {}).get(gpu_uuid)):
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
        """(job id, method) -> joules, for every job that has not expired."""
        return dict(self._energy)

    def unattributed_energy(self) -> dict[str, float]:
        """GPU UUID -> joules consumed while no job held the GPU."""
        return dict(self._unattributed)

    def jobs(self) -> dict[str, tuple[float, float, tuple[str, ...]]]:
        """job id -> (first time held, last time held, GPU UUIDs), for jobs that have not expired."""
        return {job: (self._first_held[job], t, tuple(sorted(self._gpus[job])))
                for job, t in self._last_held.items()}
