"""Who may change a run, and how much one identity may start and finish: the ledger's guard against one
client ending, joining, pre-empting or flooding other clients' runs. The ledger asks it before the OTLP store
keeps a point (``RunLedger.admit``, the store's gate), so a point refused here is never stored either.

A point's client (``core.clientid``: the identity the transport established, the kernel's peer process, a
tenant's token or an address, narrowed by the claims the training helper sends as resource attributes) is
checked before the point changes a run:

- **A run's lifecycle belongs to the run.** Each rank of a run belongs to the client that pushed its first
  point once the run pushed training progress (``Run.owners``); later points of that rank, its finish
  included, are taken only from that client (``not_run_owner``). A rank the run has not seen is added only
  by a client of the run's own node: one of its clients, or one with the same peer address and host name
  (``foreign_rank``; the ranks of a multi-rank job on one node share its principal, a Unix user or tenant,
  and host name, and each node has its own exporter). A finished run continues (``training_run_finished 0``)
  only from a client of that node (``not_run_client``). ``lifecycle_refusal`` is the rule, in one function,
  for the attribution issue to extend (a run's processes as NVML lists them).
- **A run id belongs to the identity that started it.** When a point may not change a run and its
  identity is none of the run's owners' (``collides``: another process, tenant or host pushing under the same
  run id, first or second), it is no refusal but a collision: the pusher's points go to a run of its own,
  ``<run id>~<tag>`` (``scoped_run_id``), so neither a forged copy nor a run id taken first by a neighbour
  (predictable Slurm job ids) changes the other's figures, and both runs count. Within one identity (the
  same process under other claims) the refusal stands.
- **Per-identity bounds** (counted by identity, which a sender cannot choose: its claims narrow it, never
  widen it): at most ``max_active`` runs pushing progress at once (``client_active_runs``), ``new_per_minute``
  runs starting and ``finished_per_minute`` runs finishing per minute, each a token bucket holding a minute's
  worth (``client_new_runs``, ``client_finished_runs``). A refused start leaves the run id tentative (no row, no
  energy); a refused finish leaves the run going (the helper re-sends its finish with every export; a run
  that stops pushing ends as stale). So one client's junk never locks out other clients' runs, and never
  writes more than its bound of rows and summary files.

Every refusal is counted by reason (``gpuenergy_ledger_points_refused_total``). Callers hold the ledger's
lock: nothing here locks, reads a clock of its own, or does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_energy_exporter.core.clientid import describe, identity_of, node_of, tag_of
from gpu_energy_exporter.ledger import runs
from gpu_energy_exporter.ledger.runs import Run

NOT_RUN_OWNER = "not_run_owner"
FOREIGN_RANK = "foreign_rank"
NOT_RUN_CLIENT = "not_run_client"
CLIENT_ACTIVE_RUNS = "client_active_runs"
CLIENT_NEW_RUNS = "client_new_runs"
CLIENT_FINISHED_RUNS = "client_finished_runs"
REASONS = (NOT_RUN_OWNER, FOREIGN_RANK, NOT_RUN_CLIENT, CLIENT_ACTIVE_RUNS, CLIENT_NEW_RUNS, CLIENT_FINISHED_RUNS)
#: Refusals that, between two identities, are a collision of run ids rather than a refusal (``collides``).
LIFECYCLE = frozenset({NOT_RUN_OWNER, FOREIGN_RANK, NOT_RUN_CLIENT})
#: Between a run id and the pushing identity's tag in a scoped run id.
SCOPE_SEP = "~"

_MESSAGES = {
    NOT_RUN_OWNER: "rank {rank!r} of run_id {run!r} is pushed by another client; a rank's points, its finish "
                   "included, are taken only from the client that pushed it first",
    FOREIGN_RANK: "run_id {run!r} runs elsewhere: a rank is added only by a client of the run's own node (same "
                  "user or tenant and host name)",
    NOT_RUN_CLIENT: "run_id {run!r} finished; only a client of the node it ran on may continue it",
    CLIENT_ACTIVE_RUNS: "this identity already has {limit} runs pushing progress (--runs.max-active-per-client)",
    CLIENT_NEW_RUNS: "this identity started {limit} runs in the last minute (--runs.max-new-per-client)",
    CLIENT_FINISHED_RUNS: "this identity finished {limit} runs in the last minute (--runs.max-finished-per-client); "
                          "the run goes on and its finish is taken from a later export",
}

#: Buckets of clients idle this long are forgotten (memory stays bounded by the clients of the last minutes).
_FORGET_S = 600.0
_MAX_CLIENTS = 4096


def lifecycle_refusal(owners: dict[str, str], rank: str, client: str) -> str | None:
    """Why a point of ``rank`` from ``client`` may not change a run whose ranks belong to ``owners``
    (rank -> client); None when it may. An empty ``owners`` (a run id not yet pushing progress) takes
    anyone."""
    owner = owners.get(rank)
    if owner is not None:
        return None if owner == client else NOT_RUN_OWNER
    if not owners or same_node(owners.values(), client):
        return None
    return FOREIGN_RANK


def same_node(clients: Iterable[str], client: str) -> bool:
    """Whether ``client`` is one of ``clients`` or runs on the node of one of them."""
    node = node_of(client)
    return any(c == client or node_of(c) == node for c in clients)


def collides(owners: Iterable[str], client: str) -> bool:
    """Whether a lifecycle refusal (``LIFECYCLE``) of ``client`` for a run whose ranks belong to ``owners`` is
    a collision of run ids: its identity is none of the owners'."""
    mine = identity_of(client)
    return bool(mine) and all(identity_of(c) != mine for c in owners)


def scoped_run_id(run_id: str, client: str) -> str:
    """The run id ``client``'s points are counted under when ``run_id`` belongs to another identity."""
    return f"{run_id}{SCOPE_SEP}{tag_of(client)}"


def message(reason: str, run_id: str, rank: str, bounds: ClientBounds, client: str) -> str:
    """The one clear message a refused point gets (quoted in the request's partial success)."""
    limits = {CLIENT_ACTIVE_RUNS: bounds.max_active, CLIENT_NEW_RUNS: bounds.rate(CLIENT_NEW_RUNS),
              CLIENT_FINISHED_RUNS: bounds.rate(CLIENT_FINISHED_RUNS)}
    text = _MESSAGES.get(reason, reason).format(run=run_id[:200], rank=rank[:40], limit=f"{limits.get(reason, 0):g}")
    return f"{text} (this client: {describe(client)[:300]})"


class _Bucket:
    __slots__ = ("tokens", "t")

    def __init__(self, tokens: float, t: float) -> None:
        self.tokens = tokens
        self.t = t


class ClientBounds:
    """Per-identity (``core.clientid.identity_of``) token buckets of run starts and finishes, and the refusal
    counts."""

    def __init__(self, *, max_active: int, new_per_minute: float, finished_per_minute: float) -> None:
        if max_active <= 0 or new_per_minute <= 0 or finished_per_minute <= 0:
            raise ValueError("the per-client run bounds must be positive")
        self.max_active = max_active
        self._rates = {CLIENT_NEW_RUNS: new_per_minute, CLIENT_FINISHED_RUNS: finished_per_minute}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self.refused: dict[str, float] = dict.fromkeys(REASONS, 0.0)

    def rate(self, which: str) -> float:
        return self._rates[which]

    def refuse(self, reason: str) -> str:
        self.refused[reason] = self.refused.get(reason, 0.0) + 1
        return reason

    def _bucket(self, which: str, client: str, now: float) -> _Bucket:
        key = (which, identity_of(client))
        rate = self._rates[which]
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= _MAX_CLIENTS:
                self._forget(now)
            b = self._buckets[key] = _Bucket(rate, now)
        elif now > b.t:
            b.tokens = min(rate, b.tokens + (now - b.t) * rate / 60.0)
            b.t = now
        return b

    def _forget(self, now: float) -> None:
        idle = [k for k, b in self._buckets.items() if now - b.t > _FORGET_S]
        for k in idle or list(self._buckets)[: len(self._buckets) // 2]:
            del self._buckets[k]

    def may(self, which: str, client: str, now: float) -> bool:
        """Whether ``client`` may start (``CLIENT_NEW_RUNS``) or finish (``CLIENT_FINISHED_RUNS``) a run now."""
        return self._bucket(which, client, now).tokens >= 1.0

    def take(self, which: str, client: str, now: float) -> None:
        b = self._bucket(which, client, now)
        b.tokens = max(0.0, b.tokens - 1.0)

    def too_many_active(self, starters: Iterable[str], client: str) -> bool:
        """Whether ``client``'s identity already has ``max_active`` runs going (``starters``: the client each
        active run started with)."""
        mine = identity_of(client)
        return sum(1 for c in starters if identity_of(c) == mine) >= self.max_active


def refusal(bounds: ClientBounds, run: Run, active: Iterable[Run], name: str, rank: str,
            value: float, client: str, now: float) -> str | None:
    """Why ``client`` may not change ``run`` with this point of ``rank`` (its ``contract.ATTR_RANK`` label), or
    None; ``active``: the ledger's active runs. Counts nothing (the caller counts a refusal, not a collision:
    ``collides``). A point that may records what it took (a start, a finish, a rank's owner). Once a point of a
    run that is no longer tentative is taken, the next point of the same rank and client is taken too, unless
    it is a ``training_run_finished`` of 1 or more: ``RunLedger`` relies on this to skip the call for a
    request's further points of one origin, and calls it for every finish."""
    progress = name in runs.COUNTERS or name == runs.HISTOGRAM
    if run.tentative and not run.owners:
        if not progress:
            return None  # a run id with no progress yet holds nothing and is evicted first
        # runs with owners: their start was taken (maybe not stored yet)
        if bounds.too_many_active((r.client for r in active if r.owners), client):
            return CLIENT_ACTIVE_RUNS
        if not bounds.may(CLIENT_NEW_RUNS, client, now):
            return CLIENT_NEW_RUNS
        bounds.take(CLIENT_NEW_RUNS, client, now)
        run.client, run.owners = client, {rank: client}
        return None
    # A tentative run with owners: its first progress point was taken but not stored yet (or refused by the
    # store's own bounds): it stays its owner's, as a run does.
    why = lifecycle_refusal(run.owners, rank, client)
    if why is not None:
        return why
    if (name == runs.RUN_FINISHED and value >= 1 and rank not in run.finished_at
            and run.ranks | {rank} <= set(run.finished_at) | {rank}):  # this point finishes the run
        if not bounds.may(CLIENT_FINISHED_RUNS, client, now):
            return CLIENT_FINISHED_RUNS
        bounds.take(CLIENT_FINISHED_RUNS, client, now)
    run.owners.setdefault(rank, client)
    return None


def refused(bounds: ClientBounds, run: Run, active: Iterable[Run], name: str, rank: str,
            value: float, client: str, now: float) -> bool:
    """``refusal``, counted in ``bounds`` (a collision included)."""
    why = refusal(bounds, run, active, name, rank, value, client, now)
    return why is not None and bool(bounds.refuse(why))
