"""The store's gate: what the run ledger (who owns which run) says of a request's points before any is stored.

``ask_gate(gate, points, ...)`` asks ``gate`` (``TrainingStore.set_gate``: ``RunLedger.admit``) once per
request and keeps the points it admits, marked ``admitted`` (the ledger need not check them again), each under
the run id it says: a point pushed under a run id another identity holds is moved to the pusher's scoped run id
(``rescope``: its ``run_id`` label and estimated size follow) and named in the request's response. A point it
refuses is rejected with its reason and message: never stored, folded or exposed.

Pure but for the call to ``gate``: no lock, no clock, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpu_energy_exporter.core.contract import ATTR_RUN_ID
from gpu_energy_exporter.otlp.points import Point, series_bytes

log = logging.getLogger("gpu_energy_exporter.otlp.store")

#: The gate's answer for one point: None (admitted as it is), a refusal (reason, message), or the run id it
#: is to be stored under instead (its run id is another identity's: scoped to the pusher).
Verdict = tuple[str, str] | str | None
Gate = Callable[[list[Point]], list[Verdict]]


def rescope(p: Point, run_id: str) -> None:
    """Move ``p`` to run ``run_id`` (its ``run_id`` label and the series' estimated size follow)."""
    p.labels = tuple((k, run_id if k == ATTR_RUN_ID else v) for k, v in p.labels)
    p.run_id = run_id
    p.cost = series_bytes(p.name, p.labels, p.kind, buckets=len(p.counts), quantiles=len(p.quantiles))


def ask_gate(gate: Gate, points: list[Point], reject: Callable[[str, str], None],
             notices: list[str]) -> tuple[list[Point], int]:
    """The points ``gate`` admits (marked ``admitted``; re-scoped ones under their new run id), the others
    rejected; and how many were re-scoped."""
    try:
        verdicts = gate(points)
    except Exception:  # a gate bug must never fail an export: the listeners check the points themselves
        log.exception("OTLP store gate %r failed", gate)
        return points, 0
    kept: list[Point] = []
    collisions = 0
    scoped: dict[tuple[str, str], int] = {}
    for p, verdict in zip(points, verdicts, strict=True):
        if verdict is None:
            p.admitted = True
            kept.append(p)
        elif isinstance(verdict, str):
            key = (p.run_id, verdict)
            scoped[key] = scoped.get(key, 0) + 1
            rescope(p, verdict)
            p.admitted = True
            kept.append(p)
            collisions += 1
        else:
            reject(*verdict)
    for (old, new), count in scoped.items():
        notices.append(f"run_id {old[:200]!r} belongs to another identity: {count} data point(s) stored under "
                       f"run_id {new[:240]!r} (docs/security.md, run ids)")
    return kept, collisions
