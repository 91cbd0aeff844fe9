"""Slurm jobs in the run ledger: a job holding GPUs on this node is a run, whether or not it pushes anything.

Each snapshot carries the jobs the slurm collector read in the job-mapping directory (``Snapshot.slurm_jobs``,
written by the prolog and epilog in ``deploy/slurm/``). A job seen for the first time opens a run whose id is
the job id, counted from the prolog's write of its mapping file (``SlurmJob.since``, the file's mtime, placed
on the ledger's clock through the snapshot's wall-clock stamp; the snapshot that first lists it where that is
not known), as the slurm collector charges it; the exporter reads the energy counters as soon as the
directory changes, so the job's edges fall milliseconds before counter reads. The mapping is the authority for
the job's GPUs: they are the run's, and its claim on them is confirmed by the allocation (``Holding.allocated``: never
refused by the NVML-process rule, and the processes on them that are no run's are the job's). When the job's
ranks push through the training helper under the job id (the helper's default, ``SLURM_JOB_ID``) it is the
same run: one row with tokens, J/token and MFU; ranks pushing under another run id whose job identity names
the job (the resource's ``slurm.job.id``) are taken into the job's run too (``alias``). A job run ends at
the epilog's write (``SlurmJob.until``; else the first snapshot that no longer lists the job): its ranks'
``training_run_finished`` do not end it, the epilog does; it is closed as ``finished`` with its row. An edge
dated before the previous snapshot, or more than ``max_backdate_s`` before this one, is taken there (a
clock that disagrees costs a bounded recount, never a run reaching back into the history).

The driver (``ledger.RunLedger``) calls ``track`` under its lock on the sampler thread, ``alias`` for each
point. Pure bookkeeping on the ledger's runs: no I/O, no NVML, no clock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.core.state import SlurmJob
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.snapshot_frames import Frame, uuid_key

#: metadata keys a job run carries (in the JSON summary's ``metadata``; the CSV's notes say the same)
META_JOB_ID, META_USER, META_ACCOUNT, META_PARTITION = "slurm_job_id", "slurm_user", "slurm_account", "slurm_partition"


def track(
    jobs: Sequence[SlurmJob] | None,
    prev: Frame | None,
    frame: Frame,
    active: MutableMapping[str, Run],
    new_run: Callable[[str, float], Run | None],
    changed: Callable[[Run, float], None],
    *,
    wall: float | None = None,
    max_backdate_s: float = math.inf,
) -> list[str]:
    """Open, update and end the job runs for one snapshot (``frame``; ``prev``: the one before it), before the
    ledger advances its runs over it. ``new_run(job id, start)``: a new run, or None when the ledger cannot
    take one; ``changed(run, t)``: who holds the run's GPUs changed at ``t``. ``jobs`` None (no slurm
    collector, or its directory unreadable now) changes nothing. ``wall``: the wall-clock time ``frame.t``
    stands for (the snapshot's stamp less its readings' age), which places the jobs' edges on the ledger's
    clock. Returns the job ids opened."""
    if jobs is None:
        return []
    listed: Mapping[str, SlurmJob] = {j.job_id: j for j in jobs if j.job_id and j.gpus}
    ended = {j.job_id: j.until for j in jobs if not j.gpus and j.until is not None}
    edge = _Edges(frame.t, max(prev.t if prev is not None else -math.inf, frame.t - max_backdate_s), wall)
    opened = [job_id for job_id, job in listed.items() if _hold(job, edge, active, new_run, changed)]
    for run in list(active.values()):
        if run.allocated and run.run_id not in listed and run.e is None:
            # the epilog removed it after the last snapshot that listed it, at its write (else: the interval
            # up to this snapshot was still the job's, charged to the jobs listed at its start)
            run.e = max(run.s, edge.at(ended.get(run.run_id)))
            run.status = "finishing"
            changed(run, run.e)
    return opened


@dataclass(frozen=True, slots=True)
class _Edges:
    """Places a job's edges (wall clock) on the frame clock, within (lo, t]: ``t`` the frame's time, ``lo``
    the previous frame's (or ``max_backdate_s`` before ``t``), ``wall`` the wall-clock time ``t`` stands for."""

    t: float
    lo: float
    wall: float | None

    def at(self, when: float | None) -> float:
        """``t`` when not known: the map changed in (prev.t, frame.t], and this snapshot read the counters."""
        if when is None or self.wall is None or not math.isfinite(when):
            return self.t
        return min(self.t, max(self.lo, self.t - (self.wall - when)))


def _hold(job: SlurmJob, edge: _Edges, active: MutableMapping[str, Run], new_run: Callable[[str, float], Run | None],
          changed: Callable[[Run, float], None]) -> bool:
    """Open the run of a job the directory lists (whether it was opened now), or give it the GPUs new to it."""
    start = edge.at(job.since)
    run = active.get(job.job_id)
    fresh = run is None or run.tentative
    if run is None:
        run = new_run(job.job_id, start)
        if run is None:
            return False
    if fresh:
        run.tentative = False
        run.start_accounts(min(run.s, start))
    keys = {uuid_key(u): u for u in job.gpus}
    new = set(keys) - run.allocated
    for key in new:
        run.gpus.setdefault(key, keys[key])
    run.allocated |= new
    # Seen now: a job run never goes stale while the job holds its GPUs (it pushes nothing).
    run.last_point_t = max(run.last_point_t, edge.t)
    run.last_point_received = max(run.last_point_received, edge.t)
    _describe(run, job)
    if fresh or new:
        changed(run, run.s if fresh else edge.t)
    return fresh


def _describe(run: Run, job: SlurmJob) -> None:
    """The job's identity in the run's metadata (again after each ``training_run_info``, which replaces it)."""
    meta = {META_JOB_ID: job.job_id, META_USER: job.user, META_ACCOUNT: job.account, META_PARTITION: job.partition}
    run.metadata.update({k: v for k, v in meta.items() if v})
    note = (f"Slurm job {job.job_id} (user {job.user or '?'}, account {job.account or '?'}, partition "
            f"{job.partition or '?'}): its GPUs from the job-mapping directory")
    if not any(n.startswith(f"Slurm job {job.job_id} ") for n in run.notes):
        run.notes.append(note)


def alias(active: Mapping[str, Run], run_id: str, resource: tuple[tuple[str, str], ...]) -> str:
    """The run a point pushed under ``run_id`` belongs to: the job's run when its process's resource names a
    Slurm job that is a job run here (the helper pushing under a run id of its own), else ``run_id``."""
    own = active.get(run_id)
    if own is not None and own.allocated:
        return run_id
    job = _JOBS.get(resource)
    if job is None:
        job = dict(resource).get(contract.LABEL_SLURM_JOB_ID, "")
        remember(_JOBS, resource, job, 1024)
    run = active.get(job) if job and job != run_id else None
    if run is None or not run.allocated:
        return run_id
    note = f"its ranks push under run id {run_id!r}: one run with the job"
    if note not in run.notes and len(run.notes) < 32:
        run.notes.append(note)
    return job


_JOBS: dict[tuple[tuple[str, str], ...], str] = {}  # resource -> the Slurm job id it names ("" none)
