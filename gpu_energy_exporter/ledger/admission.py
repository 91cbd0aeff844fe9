"""The run ledger's admission: who may change which run, decided before the OTLP store keeps a point.

``RunLedger.admit`` is the store's gate (``otlp.store.TrainingStore.set_gate``): for every point of a request,
before anything is stored, it answers None (admitted), a refusal (reason, message: the point is never stored,
folded or exposed, and the request's partial success quotes the message), or the run id the point is counted
under instead: a run id another identity holds is scoped to the pusher (``ledger.clients``: collisions), so a
forged copy and a run id taken first by a neighbour both leave the other run's figures as they were. What a
point may take (a run's start and owner, a rank, a finish) is recorded here, as ``_record_locked`` would for a
point that did not come through the gate (it calls ``_admit_locked`` itself). A new run takes a run slot
(``_new_run``, ``_open_job`` for a Slurm job): at most ``max_active_runs``, run ids with no training progress
giving theirs up first.

A mixin of ``RunLedger`` (``ledger.ledger``), which holds the state: everything here runs under the ledger's
lock, reads the ledger's clock once per chunk of points, and does no I/O.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.core.clientid import identity_of, tag_of
from gpu_energy_exporter.core.ratelog import RateLimitedLog
from gpu_energy_exporter.ledger import clients, jobs, points, process_claims, restart, runs, specs
from gpu_energy_exporter.ledger.runs import Run

log = logging.getLogger("gpu_energy_exporter.ledger.ledger")

_isfinite = math.isfinite
_RANK = contract.ATTR_RANK
_FINISHED = runs.RUN_FINISHED

#: ``_check_locked``: the point may not change the run and its identity is none of the run's owners'.
_COLLISION: tuple[str, str] = ("collision", "")  # compared by identity
#: The store's gate's answer for a point (``otlp.store.Verdict``): None, a refusal (reason, message), a run id.
Verdict = tuple[str, str] | str | None


class GatePoint(Protocol):
    """What the OTLP store asks its gate about (``otlp.points.Point``)."""

    run_id: str
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    time_ns: int
    resource: tuple[tuple[str, str], ...]
    client: str

_CLAIM_MESSAGES = {
    process_claims.REFUSED_JOB:
        "this process's job identity (Slurm job, torchrun rendezvous, world size) is not the run's",
    process_claims.REFUSED_WORLD: "the run already has as many processes as its world size",
    process_claims.REFUSED_RANK: "another live process pushes this rank",
}


class LedgerAdmission:
    """``admit`` and the checks behind it; the state is ``RunLedger``'s."""

    POINTS_CHUNK: int
    _lock: threading.RLock
    _clock: Callable[[], float]
    _active: dict[str, Run]
    _closed: list[Run]
    _clients: clients.ClientBounds
    _claims: specs.ClaimTally
    _admitted: tuple[object, ...] | None
    _scoped: dict[tuple[str, str], str]
    _new_process: set[str]
    _job_ids: set[str]
    _offsets: dict[str, dict[str, float]]
    _wall: Callable[[], float] | None
    _late_window_s: float
    _max_active: int
    _max_backdate_s: float
    _timeline_points: int
    _evicted: float
    _rejected: float
    _runs_log: RateLimitedLog
    warmup_s: float

    def admit(self, points: Sequence[GatePoint]) -> list[Verdict]:
        """The OTLP store's gate (``TrainingStore.set_gate``): for each point of a request, before anything is
        stored, None (admitted), a refusal (reason, message: never stored, folded or exposed), or the run id it
        is counted under instead (its run id is another identity's: ``clients.collides``). What a point may
        take is recorded here (a run's start and owner, a rank, a finish's bucket), as ``on_points`` would."""
        out: list[Verdict] = []
        admit = self._admit_locked
        for start in range(0, len(points), self.POINTS_CHUNK):
            with self._lock:
                received = self._clock()
                self._admitted = None
                for p in points[start:start + self.POINTS_CHUNK]:
                    rank = next((v for k, v in p.labels if k == _RANK), "")
                    out.append(admit(p.run_id, p.name, rank, p.value, p.time_ns / 1e9, p.resource, p.client,
                                     received))
        return out

    def _admit_locked(self, run_id: str, name: str, rank: str, value: float, t: float,
                      resource: tuple[tuple[str, str], ...], client: str, received: float) -> Verdict:
        """``admit`` for one point (lock held). A run id another identity holds is scoped to the pusher
        (``clients.scoped_run_id``), remembered while the scoped run lives, and checked as its own run."""
        if not run_id or not _isfinite(value) or not _isfinite(t):
            return None
        mine = (run_id, identity_of(client))
        scoped = self._scoped.get(mine)
        if scoped is not None and scoped not in self._active:
            del self._scoped[mine]  # the scoped run ended: the next push collides (or not) afresh
            scoped = None
        verdict = self._check_locked(scoped or run_id, name, rank, value, t, resource, client, received)
        if verdict is not _COLLISION:
            return scoped if verdict is None else verdict
        if scoped is not None:  # the scoped id is itself another identity's: no third run id
            self._clients.refuse(clients.NOT_RUN_OWNER)
            return clients.NOT_RUN_OWNER, clients.message(clients.NOT_RUN_OWNER, scoped, rank, self._clients, client)
        scoped = clients.scoped_run_id(run_id, client)
        if len(self._scoped) >= 4 * self._max_active:
            self._scoped.clear()
        self._scoped[mine] = scoped
        verdict = self._check_locked(scoped, name, rank, value, t, resource, client, received)
        if verdict is _COLLISION:
            self._clients.refuse(clients.NOT_RUN_OWNER)
            return clients.NOT_RUN_OWNER, clients.message(clients.NOT_RUN_OWNER, scoped, rank, self._clients, client)
        if verdict is None:
            self._note_collision(run_id, scoped, client)
            return scoped
        return verdict

    def _note_collision(self, run_id: str, scoped: str, client: str) -> None:
        theirs, mine = self._active.get(run_id), self._active.get(scoped)
        for run, note in ((theirs, f"another identity ({tag_of(client)}) pushed under this run id: counted as "
                                   f"run {scoped!r}"),
                          (mine, f"pushed under run id {run_id!r}, which another identity holds")):
            if run is not None and note not in run.notes and len(run.notes) < 32:
                run.notes.append(note)
                log.warning("run %s: %s (docs/security.md)", run.run_id, note)

    def _check_locked(self, run_id: str, name: str, rank: str, value: float, t: float,
                      resource: tuple[tuple[str, str], ...], client: str, received: float) -> Verdict:
        """Whether ``client`` may change run ``run_id`` with this point: None, a refusal, or ``_COLLISION``
        (it may not, and its identity is none of the run's owners'). Creates the run (tentative) at its
        first point, as ``_record_locked`` does."""
        if self._job_ids and resource:
            run_id = jobs.alias(self._active, run_id, resource)  # a job's rank under a run id of its own
        run = self._active.get(run_id)
        if run is None:
            previous = [r for r in self._closed if r.run_id == run_id]
            if previous and previous[-1].owners and points.resumes(previous[-1], name, value, t) \
                    and not clients.same_node(previous[-1].owners.values(), client):
                if clients.collides(previous[-1].owners.values(), client):
                    return _COLLISION
                self._clients.refuse(clients.NOT_RUN_CLIENT)  # only the run's own node continues it
                return clients.NOT_RUN_CLIENT, clients.message(clients.NOT_RUN_CLIENT, run_id, rank, self._clients,
                                                               client)
            if self._wall is not None:
                t = restart.steady_point_time(self._offsets, run_id, rank, t, received, self._late_window_s)
            run = self._new_run(run_id, name, value, t, client, received)
            if run is None:
                return None  # not the ledger's (a full ledger, a late point of a closed run): stored as pushed
        # Who pushed it: the points of one request share their run, rank, client and resource; once one of
        # them passed both checks, the next ones of that origin pass them too (a finish is checked each time;
        # the helper's ``training_run_finished 0``, sent with every export, finishes nothing).
        origin = (run, rank, client, resource, received)
        if origin == self._admitted and not (name == _FINISHED and value >= 1):
            return None
        self._admitted = None
        why = clients.refusal(self._clients, run, self._active.values(), name, rank, value, client, received)
        if why is not None:
            if why in clients.LIFECYCLE and clients.collides(run.owners.values(), client):
                return _COLLISION
            self._clients.refuse(why)
            return why, clients.message(why, run_id, rank, self._clients, client)
        refused, new_process = process_claims.note_process(run, resource, rank, received)
        if refused:  # another process under the run's id whose job identity disagrees (docs/ledger.md)
            self._claims.refuse(refused)
            return refused, f"run_id {run_id[:200]!r}: {_CLAIM_MESSAGES.get(refused, refused)}"
        if new_process:
            self._new_process.add(run.run_id)
        if run.owners or not run.tentative:
            self._admitted = origin
        return None

    # ------------------------------------------------------------------------------------------------
    # opening a run: a run slot

    def _new_run(self, run_id: str, name: str, value: float, t: float, client: str, received: float) -> Run | None:
        """A run for a point of a run id not active, or None: a closed run's id that the point does not resume,
        or continued from another node, or no run slot left (runs without training progress give theirs up)."""
        previous = [r for r in self._closed if r.run_id == run_id]
        if previous and not points.resumes(previous[-1], name, value, t):
            return None
        if previous and previous[-1].owners and not clients.same_node(previous[-1].owners.values(), client):
            return None  # only the run's own node continues it (refused in _check_locked)
        if len(self._active) >= self._max_active:
            # Runs that never pushed training progress give way first (oldest push first): a flood of
            # run ids without progress (e.g. training_run_finished only) cannot keep a real run out.
            idle = [r for r in self._active.values() if r.tentative]
            if idle:
                victim = min(idle, key=lambda r: r.last_point_received)
                del self._active[victim.run_id]
                self._offsets.pop(victim.run_id, None)
                self._evicted += 1
        if len(self._active) >= self._max_active:
            self._rejected += 1
            self._runs_log.warning("too many", "run ledger: already tracking %d active runs; ignoring new run %r "
                                   "(runs end on training_run_finished or after --runs.stale-after)",
                                   self._max_active, run_id)
            return None
        # A first point dated long before it arrived would make the run's start replay (and every run sharing
        # its GPUs recount) that much history: its start is taken at most max_backdate_s back (bounded cost).
        start = max(t, received - self._max_backdate_s)
        run = Run(run_id, start, self.warmup_s, not previous, self._timeline_points, self._clock())
        if start > t:
            run.notes.append(f"first point dated {received - t:.0f}s before it arrived: counted from "
                             f"{self._max_backdate_s:g}s before (--runs.max-backdate)")
        self._active[run_id] = run
        return run

    def _open_job(self, job_id: str, start: float) -> Run | None:
        """A new run for a Slurm job (``jobs.track``), or None when the ledger tracks all the runs it may."""
        if len(self._active) >= self._max_active:
            self._rejected += 1
            return None
        fresh = not any(r.run_id == job_id for r in self._closed)
        run = self._active[job_id] = Run(job_id, start, self.warmup_s, fresh, self._timeline_points, self._clock())
        log.info("run %s started: Slurm job holding GPUs on this node", job_id)
        return run
