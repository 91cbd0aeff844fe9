"""Which processes a run has: the processes that push under its id (from their OTLP resource), whether a new
one may join the run, and which of the processes NVML lists on a GPU are the run's own.

A trainer's resource says who it is (``core.contract``: ``process.pid`` in its own pid namespace, its container
and pod from its cgroup, host name) and which job it belongs to (Slurm job id, torchrun's rendezvous, world
size). The first process to push under a run id sets the run's job identity; a later process joins the run as
another rank only when that identity agrees, the world size leaves room and no other live process pushes its
rank; otherwise its points are refused and counted (``REFUSED_*``). A listed GPU process is the run's when one
of the run's processes matches it (``core.procinfo.ProcessIdentity.matches``: same pid, or the innermost
``NSpid`` inside the same container), and matches no other listed process.

Pure: no I/O, no clock, no locks (the ledger holds its lock; the time a point arrived is passed in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.ledger.split import Proc

#: Which process pushed a point: (host name, pid in its own namespace, container id, pod UID) from its resource.
ProcessKey = tuple[str, int, str, str]


class Claimant(Protocol):
    """What of a run the checks here read and record (``runs.Run`` is one; named by its attributes so that
    this module does not import ``runs``, which imports it)."""

    #: the processes that pushed for the run -> [rank, first seen, last seen]
    procs: dict[ProcessKey, list[Any]]
    #: the job identity its first process set (``contract.JOB_IDENTITY_LABELS``)
    job: dict[str, str]
    #: (resource, received, rank) of the last point admitted
    admitted: tuple[object, float, str]

#: How long a rank stays held by the process that pushed it last: another process pushing the same rank
#: within this is refused (two live processes cannot be one rank); after it, the rank's process restarted.
RANK_HELD_S = 30.0

REFUSED_JOB = "job_mismatch"  # the job identity (Slurm job, torchrun rendezvous, world size) disagrees
REFUSED_WORLD = "world_size"  # more processes than the run's world size
REFUSED_RANK = "rank_taken"  # another live process pushes that rank
REFUSED_REASONS = (REFUSED_JOB, REFUSED_WORLD, REFUSED_RANK)


def process_key(resource: Mapping[str, str]) -> ProcessKey | None:
    """The pushing process from a point's resource labels; None when it sent no usable pid."""
    try:
        pid = int(resource.get(contract.LABEL_PROCESS_PID, ""))
    except ValueError:
        return None
    if pid <= 0:
        return None
    return (resource.get(contract.LABEL_HOST_NAME, ""), pid, resource.get(contract.LABEL_CONTAINER_ID, ""),
            resource.get(contract.LABEL_POD_UID, ""))


def admit_process(run: Claimant, key: ProcessKey, resource: Mapping[str, str], rank: str, received: float) -> str:
    """"" when the process may push for the run (recorded), else the reason it is refused. The first process
    sets the run's job identity; a later one joins as another rank only when every identity label both
    have agrees, the world size leaves room, and no other live process pushes the same rank."""
    entry = run.procs.get(key)
    if entry is not None:
        entry[2] = received
        return ""
    job = {k: resource[k] for k in contract.JOB_IDENTITY_LABELS if resource.get(k)}
    if run.procs:
        if any(run.job.get(k, v) != v for k, v in job.items()):
            return REFUSED_JOB
        try:
            world = int(run.job.get(contract.LABEL_WORLD_SIZE) or job.get(contract.LABEL_WORLD_SIZE) or 0)
        except ValueError:
            world = 0
        if world and len(run.procs) >= world and not any(
                received - last > RANK_HELD_S for _, _, last in run.procs.values()):
            return REFUSED_WORLD
        if any(r == rank and received - last <= RANK_HELD_S for r, _, last in run.procs.values()):
            return REFUSED_RANK
    for k, v in job.items():
        run.job.setdefault(k, v)
    run.procs[key] = [rank, received, received]
    return ""


def note_process(run: Claimant, resource: tuple[tuple[str, str], ...], rank: str, received: float
                 ) -> tuple[str, bool]:
    """(why the point's process is refused or "", whether it is a process new to the run) for a point of
    ``run`` and ``rank`` (its ``contract.ATTR_RANK`` label) carried by a resource with ``resource`` labels
    (points with no pid are taken as they come)."""
    if not resource:
        return "", False
    # The points of one request (one ``received``) share one resource tuple: the first one decides for all
    # (this runs for every point a trainer pushes).
    if run.admitted[0] is resource and run.admitted[1] == received and run.admitted[2] == rank:
        return "", False
    found = _RESOURCES.get(resource)
    if found is None:  # one request's points share one resource tuple; a trainer repeats it every export
        attrs = dict(resource)
        found = (process_key(attrs), attrs)
        remember(_RESOURCES, resource, found, 1024)
    key, attrs = found
    if key is None:
        return "", False
    known = key in run.procs
    refused = admit_process(run, key, attrs, rank, received)
    if not refused:
        run.admitted = (resource, received, rank)
    return refused, not known and not refused


_RESOURCES: dict[tuple[tuple[str, str], ...], tuple[ProcessKey | None, dict[str, str]]] = {}


def own_pids(run: Claimant, procs: Sequence[Proc]) -> frozenset[int]:
    """The host pids among ``procs`` (listed on one GPU) that are the run's own processes: each process the
    run declared matches exactly one listed process (a pid namespace's pid alone, matching several, is
    ambiguous and matches none)."""
    out: set[int] = set()
    for _host, pid, container, pod in run.procs:
        found = [p.pid for p in procs if p.host is not None and p.host.matches(pid, container, pod)]
        if len(found) == 1:
            out.add(found[0])
    return frozenset(out)
