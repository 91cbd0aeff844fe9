"""What lets the run ledger's runs outlive the exporter and its clocks: the store's checkpoints and their
restore, the rows' way to the database and the exports, and the mapping of every time the ledger sees onto one
steady axis.

- **Restart.** ``Durable`` writes the open runs' state (``ledger.codec``), the latest snapshot frame and every
  closed run's row into the database (``ledger.store``, on the store's own thread: every
  ``journal_interval_s`` and whenever a run starts; a closing run's row at once, in the transaction that drops
  its open state) and restores them when the ledger starts (``ledger.recovery`` opens the store, migrates a
  previous release's journal, and says what was lost; ``ledger.restore`` decodes each record): a restored run
  goes on as the same run, settled across the restart from each GPU's last counter read (``ledger.carry``). The
  frame is
  put back at the head of the snapshot history, so the first snapshot after the restart closes the gap as
  one ordinary interval: the GPU's energy counter (cumulative in the driver) across the downtime, shared
  with the shares known before it, and the run notes ``gap_s``. Tokens are cumulative in the trainer: a
  restored series takes the trainer's next value as it comes (nothing counts twice, nothing is lost);
  should that value be lower (the exporter's folding of an earlier trainer restart was lost with the
  process) the series continues from its restored count (``reconcile``).
- **Exports.** A row in the database is then written to ``--runs.csv`` and its JSON summary by the file
  writer's thread (``ledger.filewriter``), and marked exported; a row not exported yet when the process
  stops is exported after the restart, once.
- **Time.** The ledger runs on the steady clock (``journal.SteadyClock``): a snapshot is dated when the
  ledger receives it (``on_clock``), and a point's trainer timestamp is placed relative to when it arrived
  (``steady_point_time``): it keeps its order and spacing within its stream, but a sender's clock that is
  off or steps moves no energy between runs.

This module never reads hardware and never writes files itself (``store`` and ``filewriter`` do); it
holds the ledger's lock only to copy state, one run at a time.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import sqlite3
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpu_energy_exporter.core.runs_db import DB_NAME
from gpu_energy_exporter.ledger import carry, codec, recovery, restore
from gpu_energy_exporter.ledger.filewriter import FileWriter, Row
from gpu_energy_exporter.ledger.journal import SteadyClock
from gpu_energy_exporter.ledger.runs import LabelKey, Run
from gpu_energy_exporter.ledger.snapshot_frames import Frame
from gpu_energy_exporter.ledger.store import Batch, Saved, Store, StoredRow, StoreWriter, damaged

log = logging.getLogger(__name__)

#: A new stream's first point is taken at its own time when it says it was taken at most this long before
#: it arrived (an export's usual delay); otherwise the sender's clock is off and it is placed at arrival.
FIRST_TOLERANCE_S = 5.0
#: How long the first snapshot after a restart may wait for every GPU's energy counter to be readable
#: again (the driver's counter is confirmed by two readings) before the gap is closed without it.
GAP_WAIT_S = 30.0
#: Shutdown: the most the ledger waits for its last checkpoint and for the rows still to write.
SHUTDOWN_STORE_S = 2.0
SHUTDOWN_FILES_S = 1.5
#: A run's timeline (most of its saved bytes) is saved with its state at most this often (and at the last
#: checkpoint before a stop): a SIGKILL loses at most this much of a timeline, never energy or tokens.
TIMELINE_EVERY_S = 60.0
#: Rows waiting to be written, at most, in memory (each holds its run's summary and timeline); beyond, a row
#: already in the database waits there and is exported at the next start.
MAX_PENDING = 1000


def on_clock(frame: Frame, now: float) -> Frame:
    """``frame`` dated on the steady clock: ``now``, when the ledger received it (right after the sampler
    made it), less the age of its GPU readings then (``Frame.age``, measured on the monotonic clock). Not
    its wall-clock stamp moved by the clocks' offset: a step between the two readings would put it an hour
    away, and a frame in the future would stop the ledger counting until then."""
    return replace(frame, t=now - frame.age)


def steady_point_time(offsets: dict[str, dict[str, float]], run_id: str, rank: str, t: float, received: float,
                      late_window_s: float) -> float:
    """A point's time on the ledger's clock: its own timestamp ``t`` plus the offset of its sender's clock
    (per run and rank), never after it arrived (``received``).

    The offset is 0 while the sender's clock agrees with ours; it is learned from the first point that
    says it was taken more than ``FIRST_TOLERANCE_S`` before it arrived or after it arrived (a skewed
    clock), lowered whenever a point arrives sooner than the offset says (a forward step: the point lands
    at its arrival, after the stream's earlier ones), and learned again when a point would fall more than
    ``late_window_s`` before its arrival (a backward step). Points of one stream keep their order and
    spacing; a late point (a retried export) stays late."""
    ranks = offsets.setdefault(run_id, {})
    raw = received - t  # how long before it arrived the point says it was taken
    off = ranks.get(rank)
    if off is None:
        off = 0.0 if 0.0 <= raw <= FIRST_TOLERANCE_S else raw
    elif raw < off or t + off < received - late_window_s:
        off = raw
    ranks[rank] = off
    return t + off


def reconcile(run: Run, name: str, labels: Mapping[str, str], value: float, key: LabelKey | None) -> None:
    """The first point of a restored run's counter series since the restart: a value below the restored
    one means the folding of an earlier trainer restart was lost with the old process; the series goes on
    from its restored count instead of going backwards."""
    assert run.restored is not None
    k = (name, key if key is not None else tuple(sorted(labels.items())))
    if run.restored.get(k):
        return
    run.restored[k] = True
    s = run.series.get(k)
    if s is None or value >= s.last_v:
        return
    drop = s.last_v - value
    s.baseline -= drop
    s.last_v = value
    if s.at_w is not None:
        s.at_w -= drop
    note = ("a counter came back lower after the exporter restarted (the trainer had restarted before): "
            "counted on from its restored value")
    if note not in run.notes:
        run.notes.append(note)


class Durable:
    """The ledger's store and exports (either may be absent). ``ledger``: the ``RunLedger``; ``db_path``:
    ``--runs.db`` (default: ``runs.db`` in ``state_dir``)."""

    def __init__(self, ledger: Any, state_dir: str | None, threaded: bool, interval_s: float,
                 db_path: str | None = None) -> None:
        self._ledger = ledger
        self._interval = interval_s
        self._last_kick = -math.inf
        self.store: Store | None = None
        self._sw: StoreWriter | None = None
        self.writer: FileWriter | None = None
        self.gap_pending = False
        self.carried: dict[str, carry.GPUAnchor] = {}  # GPU key -> its last counter read before the restart
        self._gap_since: float | None = None
        self.losses = recovery.Losses(ledger.stale_after_s)
        self._unsaved: list[Row] = []  # closed runs' rows not in the database yet (ledger lock)
        self._exported: list[tuple[int, str | None]] = []  # rows exported since the last batch
        self._building: tuple[list[Row], int, int] = ([], 0, 0)
        self._failing = False
        # Timelines (the bulk of a run's state) are saved every TIMELINE_EVERY_S and at the last checkpoint:
        # run id -> (the run, when its timeline was last saved); and those in the batch being written.
        self._timeline_saved: dict[str, tuple[Run, float]] = {}
        self._timeline_due: list[tuple[str, Run, float]] = []
        self._final = False
        path = db_path or (os.path.join(state_dir, DB_NAME) if state_dir is not None else None)
        if path is not None:
            self.store = recovery.open_store(path, state_dir, self.losses, ledger._clock())
        if ledger.csv_path is not None:
            self.writer = FileWriter(ledger.csv_path, on_written=self._written, on_failed=self._failed,
                                     journaled=self._stored if self.store is not None else None,
                                     clock=ledger._clock, threaded=threaded)
        if self.store is not None:
            # Hundreds of thousands of tuples are made at once (timelines): the cyclic collector would rescan
            # them at every allocation threshold, 40% of the restore's time, for no cycle among them.
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._load()
            finally:
                if collecting:
                    gc.enable()
        if self.store is not None:
            self._sw = StoreWriter(self.store, self._build, self._batch_done, self._store_failed)
            self._last_kick = ledger._clock()
            self._sw.kick(full=True)  # the state as restored, and what was lost, at once

    def _load(self) -> None:
        """Read the store and restore what it holds (a database that opens but does not read: left as it is,
        or, damaged, replaced)."""
        ledger = self._ledger
        if self.store is not None:
            saved: Saved | None = None
            try:
                saved = self.store.load(MAX_PENDING)
            except (sqlite3.Error, OSError) as exc:  # a database that opens but does not read
                self.store.close(checkpoint=False)
                if not damaged(exc):
                    unavailable = f"cannot read {self.store.path} ({exc})"
                    log.error("run ledger: %s: runs kept in memory; the file is left as it is", unavailable)
                    self.losses.unknown(recovery.REFUSED, unavailable, ledger._clock(), store=False)
                    self.store = None
                else:
                    self.store = recovery.replace_damaged(self.store.path, exc, self.losses, ledger._clock())
                try:
                    saved = self.store.load(MAX_PENDING) if self.store is not None else None
                except (sqlite3.Error, OSError) as again:
                    log.error("run ledger: cannot read the new database either (%s): runs kept in memory", again)
                    self.store = None
            if saved is not None:
                self._restore(saved)

    @property
    def keeps_rows(self) -> bool:
        """Whether a closed run becomes a row (written to the database, the CSV or both)."""
        return self.store is not None or self.writer is not None

    # -- batches (the store's thread) -----------------------------------------------------------------

    def _build(self, full: bool) -> Batch:
        led = self._ledger
        encoded: dict[str, tuple[Run, float, Any, Any]] = {}
        extra: dict[str, Any] = {}
        self._timeline_due = []
        if full:
            with led._lock:
                now = led._clock()
                if led._history:
                    extra["frame"] = codec.encode(led._history[-1])
                state = carry.capture(led._history)
                if isinstance(led._clock, SteadyClock):
                    extra["clock"] = codec.encode(led._clock)
                runs = [r for r in led._active.values() if not r.tentative]
                saved_tl = self._timeline_saved = {k: v for k, v in self._timeline_saved.items() if k in led._active}
            for run in runs:
                with led._lock:  # one run at a time: points and snapshots wait for one run's copy, never all
                    if led._active.get(run.run_id) is not run:
                        continue
                    self.losses.note(run)
                    last = saved_tl.get(run.run_id)
                    due = self._final or last is None or last[0] is not run or now - last[1] >= TIMELINE_EVERY_S
                    timeline = codec.encode(run.timeline) if due else None
                    encoded[run.run_id] = (run, run.s, codec.encode(run, recovery.TIMELINE), timeline)
                    at = carry.settled_at(state)
                    if at is not None:
                        state.bases[run.run_id] = carry.base(run, at, led._history, led._holders)
            extra["carry"] = codec.encode(state)  # what settles across a restart (ledger.carry)
        with led._lock:
            saved = led._clock()
            rows = list(self._unsaved)
            exported = list(self._exported)
            losses = list(self.losses.unsaved)
            encoded = {k: v for k, v in encoded.items() if led._active.get(k) is v[0]}
            # a closed run's saved state leaves with its row, unless a new instance of it is going already
            closed = [r.run_id for r in rows if r.run_id not in led._active or led._active[r.run_id].tentative]
            meta = {"seq": str(led._seq), "finished_counts": json.dumps(led._finished_counts),
                    "saved_unix": repr(saved)}
        self._building = (rows, len(exported), len(losses))
        batch = Batch(full=full, closed=closed, exported=exported, meta=meta, losses=losses,
                      rows=[StoredRow(r.seq, r.run_id, r.start, r.summary, r.doc, exported=self.writer is None,
                                      summary_name=r.json_name) for r in rows])
        for run_id, (run, start, data, timeline) in encoded.items():
            batch.open_runs[run_id] = (start, saved, codec.dumps(data),
                                       codec.dumps(timeline) if timeline is not None else None)
            if timeline is not None:
                self._timeline_due.append((run_id, run, saved))
        for key, data in extra.items():
            batch.meta[key] = codec.dumps(data)
        return batch

    def _batch_done(self, batch: Batch) -> None:
        led = self._ledger
        rows, n_exported, n_losses = self._building
        done = {id(r) for r in rows}
        for run_id, run, saved in self._timeline_due:
            self._timeline_saved[run_id] = (run, saved)
        self._timeline_due = []
        with led._lock:
            self._unsaved = [r for r in self._unsaved if id(r) not in done]
            del self._exported[:n_exported]
            del self.losses.unsaved[:n_losses]
            for row in rows:
                row.extra["stored"] = True
                if self.writer is None:
                    led._pending.pop(row.seq, None)  # nothing else to write
            led._version += 1
        if self._failing:
            self._failing = False
            log.warning("run ledger: writing %s works again", self.store.path if self.store else "the database")

    def _stored(self, ticket: int, timeout: float) -> bool:
        return self._sw is None or self._sw.wait(ticket, timeout)

    def _store_failed(self, exc: OSError) -> None:
        led = self._ledger
        with led._lock:
            led._write_errors += 1
            led._version += 1
        if not self._failing:
            self._failing = True
            log.error("run ledger: cannot write the database (%s); retrying. Finished runs are kept in memory until "
                      "it works; open runs may not survive a restart meanwhile", exc)

    # -- restore ---------------------------------------------------------------------------------------

    def _restore(self, saved: Saved) -> None:
        led = self._ledger
        report = codec.Decoded()
        clock = restore.meta(saved, "clock", report, self.losses)
        same_axis = (isinstance(led._clock, SteadyClock) and isinstance(clock, SteadyClock)
                     and led._clock.adopt(clock))
        now = led._clock()
        frame = restore.meta(saved, "frame", report, self.losses)
        if not isinstance(frame, Frame):
            frame = None
        elif frame.t > now:
            log.warning("run ledger: the last saved snapshot is dated after now (the machine rebooted with its "
                        "clock behind?): the downtime's energy is not counted")
            frame = None
        for record in saved.open_runs:
            run = restore.run(*record[:5], losses=self.losses)
            if run is None:
                continue
            run.timeline, tl_saved = restore.timeline(run, *record[5:], losses=self.losses,
                                                      points=led._timeline_points)
            if tl_saved is not None:
                self._timeline_saved[run.run_id] = (run, tl_saved)
            run.restored = {}
            run.last_point_received = now  # it gets --runs.stale-after from now to push again
            run.checkpoints = deque()
            run.alive_checkpoint = run.acc.copy()
            run.live_memo = run.settled_memo = None
            led._active[run.run_id] = run
        if frame is not None and led._active:
            led._history.append(frame)
            self.gap_pending = True
            self.carried = carry.apply(restore.meta(saved, "carry", report, self.losses), led, frame)
        if self.writer is not None:  # without a CSV they wait in the database
            for values in saved.rows:
                row = restore.row(values, self.losses)
                row.extra["queued"] = now
                row.extra["stored"] = True
                led._pending[row.seq] = row
                self.writer.submit(row)
        if saved.more_rows:
            log.warning("run ledger: %d more finished run(s) wait in %s to be written to --runs.csv; they are written "
                        "after a later start", saved.more_rows, self.store.path if self.store else "the database")
        try:
            seq = int(saved.meta.get("seq", "0"))
        except ValueError:
            seq = 0
        led._seq = max(led._seq, seq, saved.max_seq)
        counts = restore.meta(saved, "finished_counts", report, self.losses)
        for status, count in (counts.items() if isinstance(counts, dict) else ()):
            if isinstance(count, (int, float)):
                led._finished_counts[status] = max(led._finished_counts.get(status, 0.0), float(count))
        led._holders_gen += 1
        led._version += 1
        log.info("run ledger: restored %d open run(s) and %d row(s) still to write from %s%s",
                 len(led._active), len(led._pending), self.store.path if self.store else "?",
                 "" if same_axis else " (another boot: the downtime is measured by the wall clock)")

    # -- the gap -------------------------------------------------------------------------------------

    def gap_ready(self, prev: Frame, frame: Frame) -> bool:
        """Whether the first snapshot after a restart can close the gap: every GPU whose counter the
        saved snapshot had is readable again (or ``GAP_WAIT_S`` passed)."""
        if self._gap_since is None:
            self._gap_since = frame.t
        if frame.t - self._gap_since > GAP_WAIT_S:
            return True
        return all(g.energy_j is not None for k, g in frame.gpus.items()
                   if k in prev.gpus and prev.gpus[k].energy_j is not None) and \
            all(k in frame.gpus for k, g in prev.gpus.items() if g.energy_j is not None)

    def note_gap(self, prev: Frame, frame: Frame) -> None:
        """The restart's gap (``prev``: the saved snapshot, ``frame``: the first one since) is about to be
        counted as one interval: each restored run says so."""
        self.gap_pending = False
        gap = frame.t - prev.t
        for run in self._ledger._active.values():
            if run.restored is None:
                continue
            run.notes.append(f"the exporter restarted during the run: gap_s={gap:.1f}, the gap's energy is the "
                             "increase of the GPU energy counter across it, shared as before the gap")
            for key in run.gpus:
                if key in self.carried:
                    continue  # settled across the restart, or its loss said, at its first counter read
                g0, g1 = prev.gpus.get(key), frame.gpus.get(key)
                if g0 is not None and g1 is not None and g0.energy_j is not None and (
                        g1.energy_j is None or g1.energy_j < g0.energy_j):
                    run.notes.append("the GPU energy counter went back across the restart (driver reload?): "
                                     "the gap's energy is missing")
                    break

    # -- rows ----------------------------------------------------------------------------------------

    def started(self) -> None:
        """A run started (ledger lock held): save it now, not at the next periodic checkpoint."""
        if self._sw is not None:
            self._sw.kick(full=True)

    def closed(self, row: Row) -> None:
        """A run closed (ledger lock held): its row to the database (its open state leaving in the same
        transaction), then to the exports."""
        led = self._ledger
        row.extra["queued"] = led._clock()
        run = row.extra.get("run")
        note = self.losses.note(run) if run is not None else None
        if note and run is not None:
            for doc in (row.summary, row.doc, run.summary if run.summary is not None else {}):
                doc["ledger_notes"] = "; ".join(x for x in (doc.get("ledger_notes"), note) if x)
        if self._sw is not None:
            self._unsaved.append(row)
            row.ticket = self._sw.kick()
        if self.writer is not None:
            self.writer.submit(row)
        if len(led._pending) > MAX_PENDING:  # a file system down for days: memory stays bounded
            oldest = min(led._pending)
            dropped = led._pending.pop(oldest)
            if self.writer is not None:
                self.writer.discard(oldest)
            if dropped.extra.get("stored"):
                log.error("run ledger: more than %d runs waiting to be written; run %s waits in the database and is "
                          "written to --runs.csv at the next start", MAX_PENDING, dropped.run_id)
            else:
                self._unsaved = [r for r in self._unsaved if r is not dropped]
                log.error("run ledger: more than %d runs waiting to be written; giving up on run %s", MAX_PENDING,
                          dropped.run_id)

    def _written(self, row: Row) -> None:
        led = self._ledger
        with led._lock:
            led._pending.pop(row.seq, None)
            led._version += 1
            run = row.extra.get("run")
            if run is not None and run.summary is not None:
                run.summary["summary_file"] = row.summary.get("summary_file")
            if self._sw is not None:
                self._exported.append((row.seq, row.json_name))
        if row.failures:
            log.warning("run %s: written to the run ledger after %d failed attempt(s)", row.run_id, row.failures)
        if self._sw is not None:
            self._sw.kick()  # the row is marked exported

    def _failed(self, row: Row, exc: OSError, first: bool) -> None:
        led = self._ledger
        with led._lock:
            led._write_errors += 1
            led._version += 1
        if first:
            log.error("run %s: cannot write the run ledger (%s: %s); the run is kept%s and retried until it is "
                      "written. Check that the directory of --runs.csv exists and is writable.",
                      row.run_id, getattr(exc, "filename", None) or led.csv_path, exc.strerror or exc,
                      " in the database" if self.store is not None else "")

    def backlog_s(self) -> float:
        """How long the oldest unwritten row has waited (ledger lock held)."""
        led = self._ledger
        if not led._pending:
            return 0.0
        oldest = min(row.extra.get("queued", 0.0) for row in led._pending.values())
        return max(0.0, led._clock() - oldest)

    # -- driving -------------------------------------------------------------------------------------

    def after_snapshot(self, now: float) -> None:
        """After each snapshot (sampler thread, no lock): due writes without a thread, a periodic
        checkpoint."""
        if self.writer is not None:
            self.writer.poll(now)
        if self._sw is not None and now - self._last_kick >= self._interval:
            self._last_kick = now
            self._sw.kick(full=True)

    def shutdown(self) -> None:
        """The last checkpoint and the rows still to write, each within its time; what is not written stays
        in the database (or, when the database cannot be written either, is logged by the ledger as lost)."""
        if self._sw is not None:
            self._final = True  # every timeline too
            self._sw.wait(self._sw.kick(full=True), SHUTDOWN_STORE_S)
        if self.writer is not None:
            self.writer.drain(SHUTDOWN_FILES_S)
            self.writer.close()
        if self._sw is not None:
            self._sw.wait(self._sw.kick(), SHUTDOWN_STORE_S / 2)
            self._sw.close()
        led = self._ledger
        with led._lock:
            kept = [r.run_id for r in led._pending.values() if r.extra.get("stored")]
            lost = [r.run_id for r in led._pending.values() if not r.extra.get("stored")]
        if kept:
            log.warning("run ledger: %d finished run(s) not written to %s yet: %s (kept in the database, written at "
                        "the next start)", len(kept), led.csv_path, ", ".join(kept))
        if lost:
            log.error("run ledger: %d finished run(s) could not be written in time and are lost at shutdown: %s",
                      len(lost), ", ".join(lost))
