"""What a restart restores from the ledger's database, record by record: an open run's state and its timeline,
a finished run's row still to export, the saved clock, snapshot and counters (``meta``). ``ledger.restart``
puts them back into the ledger.

Every record is checked (its CRC) and decoded on its own (``ledger.codec``): a damaged one costs only what it
held, and says so (``recovery.Losses``: the log, the metric, the run's row). Pure but for logging: no lock, no
thread, no file.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.ledger import codec
from gpu_energy_exporter.ledger.accounting import Timeline
from gpu_energy_exporter.ledger.filewriter import Row
from gpu_energy_exporter.ledger.recovery import DAMAGED_RECORD, Losses
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.store import Saved, crc

log = logging.getLogger(__name__)


def meta(saved: Saved, key: str, report: codec.Decoded, losses: Losses) -> Any:
    """The saved value ``key`` of the ledger (clock, frame, counters), or None (a damaged one: logged)."""
    text = saved.meta.get(key)
    if text is None:
        return None
    try:
        return codec.loads(text, report)
    except codec.DecodeError as exc:
        log.error("run ledger: the saved %s is damaged (%s): not restored", key, exc)
        losses.counts[DAMAGED_RECORD] += 1
        return None


def run(run_id: Any, start: Any, saved: Any, checksum: Any, state: Any, *, losses: Losses) -> Run | None:
    """A saved open run's state, decoded; None (the run named, its loss logged and counted) when its record is
    damaged. Fields that did not decode take their defaults (logged): the run is kept."""
    name = str(run_id)
    start_t = float(start) if isinstance(start, (int, float)) else None
    saved_t = float(saved) if isinstance(saved, (int, float)) else None
    report = codec.Decoded()
    try:
        if not isinstance(state, str):
            raise codec.DecodeError("no state")
        if crc(state) != checksum:
            raise codec.DecodeError("its record fails its checksum")
        found = codec.loads(state, report)
        if not isinstance(found, Run) or found.run_id != name:
            raise codec.DecodeError("it is not this run's state")
    except codec.DecodeError as exc:
        losses.run(DAMAGED_RECORD, name, start_t, saved_t, f"its saved record is damaged: {exc}")
        return None
    if report.problems:
        log.warning("run ledger: run %r restored; these fields of its record did not decode and took their "
                    "defaults: %s", name, ", ".join(report.problems))
    return found


def timeline(run: Run, saved: Any, checksum: Any, text: Any, *, losses: Losses, points: int
             ) -> tuple[Timeline, float | None]:
    """A restored run's timeline and when it was saved (a fresh one of ``points``, noted, when it was not saved
    or does not decode: the run's figures are in its state, only the plot's points are lost)."""
    fresh = Timeline(points)
    if text is None:
        return fresh, None
    try:
        if not isinstance(text, str) or crc(text) != checksum:
            raise codec.DecodeError("its record fails its checksum")
        restored = codec.loads(text)
        if not isinstance(restored, Timeline):
            raise codec.DecodeError("it is not a timeline")
    except codec.DecodeError as exc:
        log.error("run ledger: run %r restored without its timeline (%s): its plots start at the restart",
                  run.run_id, exc)
        losses.counts[DAMAGED_RECORD] += 1
        run.notes.append("its timeline was lost at a restart (a damaged record): plots start there")
        return fresh, None
    return restored, float(saved) if isinstance(saved, (int, float)) else None


def row(values: dict[str, Any], losses: Losses) -> Row:
    """A finished run's row from the database, to export (a damaged document: made from its columns)."""
    summary = doc = None
    try:
        summary = json.loads(values.get("summary") or "")
        doc = json.loads(values.get("document") or "")
    except ValueError:
        pass
    if not isinstance(summary, dict) or not isinstance(doc, dict):
        note = "the ledger's record of this run was damaged: its row is made from the database's columns"
        log.error("run ledger: the saved row of run %r is damaged: exported from its columns (its JSON summary "
                  "lacks the timeline)", values.get("run_id"))
        losses.counts[DAMAGED_RECORD] += 1
        summary = {c: values.get(c) for c in COLUMN_NAMES}
        summary["ledger_notes"] = "; ".join(x for x in (summary.get("ledger_notes"), note) if x)
        doc = {"run_id": values.get("run_id"), "start_unix": values.get("start_unix"),
               "end_unix": values.get("end_unix"), **summary}
    start = values.get("start_unix")
    return Row(int(values["seq"]), str(values.get("run_id")), float(start) if isinstance(start, (int, float))
               else 0.0, summary, doc, values.get("summary_name"), True)
