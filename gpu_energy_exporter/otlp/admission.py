"""Admission to the training store: whether one more series fits its bounds, and which names a new family
may not take. Each check returns ``None`` or a refusal (reason, message); the message names the bound and
its ``--otlp.*`` flag, and is what the request's ``partial_success`` quotes.

Bounds (each a ``--otlp.*`` flag):

- Per identity (``core.clientid``): at most ``max_series_per_client`` series and ``max_bytes_per_client``
  bytes (``Holdings``), so one identity filling its quota never keeps another out.
- Count and bytes: at most ``max_series`` series, ``max_series_per_run`` per run id and ``max_bytes``
  estimated bytes (``points.series_bytes``).
- Fair admission: one request may create at most ``max_new_runs_per_request`` new run ids and
  ``max_new_series_per_request`` new series, and add at most a quarter of ``max_bytes`` in new series, so
  one client (a bug or a flood of made-up run ids) cannot take the whole store in one request; series
  that already exist always keep updating.
- Names: a pushed family must not produce a sample name that another family produces (``s`` summary
  gives ``s``, ``s_count``, ``s_sum``; ``x_total`` counter gives ``x``, ``x_total``, ``x_created``;
  histograms add ``_bucket``) or a reserved one (``target``, ``target_info``, ``up``, ``scrape_*``; the
  ``gpuenergy_`` prefix is refused at translation). The family pushed later is rejected
  (``name_collision``), so the exposition always parses.

Pure: plain values in, a refusal or ``None`` out (``Holdings`` only counts). This module never changes the store,
never evicts (the store sweeps when ``store_refusal`` says it is full, then asks again), never takes a lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_energy_exporter.otlp.points import Kind
from gpu_energy_exporter.otlp.series import Family, claimed_names

#: (reason, message): why a point was not stored.
Refusal = tuple[str, str]

#: Names no pushed family may produce: target_info is the resources' family (``target`` its OpenMetrics
#: name); ``up`` and ``scrape_*`` are written by Prometheus itself for every target.
RESERVED_NAMES = frozenset({"target", "target_info", "up"})
RESERVED_NAME_PREFIXES = ("scrape_",)


@dataclass
class Request:
    """Admission state of one ``apply`` (one request): what it created so far."""

    new_runs: set[str]
    new_series: int = 0
    new_bytes: int = 0
    swept: bool = False

    def refusal(self, run_id: str, known_run: bool, cost: int, *, max_new_runs: int, max_new_series: int,
                max_bytes: int) -> Refusal | None:
        """The per-request allowances for one more series of ``cost`` bytes (they never need a sweep)."""
        if not known_run and run_id not in self.new_runs and len(self.new_runs) >= max_new_runs:
            return ("new_runs_per_request", f"this request already started {max_new_runs} "
                    "new run ids (--otlp.max-new-runs-per-request); send each run's points on its own")
        if self.new_series >= max_new_series:
            return ("new_series_per_request", f"this request already created {max_new_series} "
                    "new series (--otlp.max-new-series-per-request); the rest are accepted from the next one")
        if self.new_bytes + cost > max_bytes // 4:
            return ("new_bytes_per_request", f"this request already created {self.new_bytes} bytes of new "
                    f"series, the most one request may add is a quarter of --otlp.max-bytes ({max_bytes})")
        return None


def store_refusal(run_id: str, cost: int, *, series: int, used_bytes: int, run_series: int, max_series: int,
                  max_bytes: int, max_series_per_run: int) -> Refusal | None:
    """Room in the store for one more series of ``cost`` bytes, given what it holds (``series`` in all,
    ``used_bytes``, ``run_series`` of this run id)."""
    if series >= max_series:
        return ("series_limit", f"the receiver holds {max_series} series (--otlp.max-series)")
    if used_bytes + cost > max_bytes:
        return bytes_refusal(used_bytes, cost, max_bytes)
    if run_series >= max_series_per_run:
        return ("run_series_limit",
                f"run_id {run_id[:200]!r} has {max_series_per_run} series (--otlp.max-series-per-run)")
    return None


class Holdings:
    """What each identity holds, series and bytes, against its quota (``--otlp.max-series-per-client``,
    ``--otlp.max-bytes-per-client``): one identity filling its quota never keeps another out. The anonymous
    identity "" (points stored by the exporter's own callers, not pushed over a socket) has no quota. The
    store's lock guards it."""

    def __init__(self, max_series: int, max_bytes: int) -> None:
        self.max_series = max_series
        self.max_bytes = max_bytes
        self._held: dict[str, list[int]] = {}

    def add(self, identity: str, series: int, cost: int) -> None:
        if not identity:
            return
        held = self._held.setdefault(identity, [0, 0])
        held[0] += series
        held[1] += cost
        if held[0] <= 0:
            del self._held[identity]

    def refusal(self, identity: str, cost: int) -> Refusal | None:
        """Room for one more series of ``cost`` bytes in ``identity``'s quota, or a refusal."""
        held = self._held.get(identity)
        if held is None:
            return None
        if held[0] >= self.max_series:
            return ("client_series_limit", f"this identity ({identity[:120]}) holds {held[0]} series, the most one "
                    "may (--otlp.max-series-per-client); its idle series are evicted after --otlp.evict-idle-after")
        return self.grow_refusal(identity, cost)

    def grow_refusal(self, identity: str, more: int) -> Refusal | None:
        """Room for ``more`` bytes in ``identity``'s quota (a series growing), or a refusal."""
        held = self._held.get(identity)
        if held is None or more <= 0 or held[1] + more <= self.max_bytes:
            return None
        return ("client_bytes_limit", f"this identity ({identity[:120]}) holds {held[1]} bytes of series, {more} "
                f"more would pass --otlp.max-bytes-per-client ({self.max_bytes})")


def bytes_refusal(used_bytes: int, more: int, max_bytes: int) -> Refusal:
    return ("bytes_limit", f"the receiver holds {used_bytes} bytes of series, {more} more would pass "
            f"--otlp.max-bytes ({max_bytes})")


def name_collision(name: str, kind: Kind, claims: Mapping[str, str], families: Mapping[str, Family]) -> Refusal | None:
    """A new family ``name`` must not use a name another family (``claims``: exposed name -> family) or the
    exporter uses."""
    for claimed in claimed_names(name, kind):
        if claimed in RESERVED_NAMES or claimed.startswith(RESERVED_NAME_PREFIXES):
            return ("name_collision", f"{name} ({kind}) would expose {claimed!r}, a name reserved for "
                    "target_info or Prometheus; rename the metric")
        owner = claims.get(claimed)
        if owner is not None and owner != name:
            return ("name_collision", f"{name} ({kind}) would expose {claimed!r}, which the "
                    f"{families[owner].kind} {owner!r} already exposes; rename one of them")
    return None
