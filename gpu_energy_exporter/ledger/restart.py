"""What lets the run ledger's runs outlive the exporter and its clocks: the journal checkpoints and their
restore, the file writer's bookkeeping, and the mapping of every time the ledger sees onto one steady axis.

- **Restart.** ``Durable`` checkpoints the open runs, the rows not yet written and the latest snapshot frame
  into the journal (``ledger.journal``, on its own thread, every ``journal_interval_s`` and whenever a run
  closes) and restores them when the ledger starts: a restored run goes on as the same run. The frame is
  put back at the head of the snapshot history, so the first snapshot after the restart closes the gap as
  one ordinary interval: the GPU's energy counter (cumulative in the driver) across the downtime, shared
  with the shares known before it, and the run notes ``gap_s``. Tokens are cumulative in the trainer: a
  restored series takes the trainer's next value as it comes (nothing counts twice, nothing is lost);
  should that value be lower (the exporter's folding of an earlier trainer restart was lost with the
  process) the series continues from its restored count (``reconcile``).
- **Time.** The ledger runs on the steady clock (``journal.SteadyClock``): a snapshot is dated when the
  ledger receives it (``on_clock``), and a point's trainer timestamp is placed relative to when it arrived
  (``steady_point_time``): it keeps its order and spacing within its stream, but a sender's clock that is
  off or steps moves no energy between runs.

This module never reads hardware and never writes files itself (``journal`` and ``filewriter`` do); it
holds the ledger's lock only to copy state.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpu_energy_exporter.core.ratelog import RateLimitedLog
from gpu_energy_exporter.ledger.filewriter import FileWriter, Row
from gpu_energy_exporter.ledger.frames import Frame
from gpu_energy_exporter.ledger.journal import FORMAT, Journal, JournalWriter, SteadyClock
from gpu_energy_exporter.ledger.runs import LabelKey, Run

log = logging.getLogger(__name__)

#: A new stream's first point is taken at its own time when it says it was taken at most this long before
#: it arrived (an export's usual delay); otherwise the sender's clock is off and it is placed at arrival.
FIRST_TOLERANCE_S = 5.0
#: How long the first snapshot after a restart may wait for every GPU's energy counter to be readable
#: again (the driver's counter is confirmed by two readings) before the gap is closed without it.
GAP_WAIT_S = 30.0
#: Shutdown: the most the ledger waits for its last checkpoint and for the rows still to write.
SHUTDOWN_JOURNAL_S = 2.0
SHUTDOWN_FILES_S = 1.5
#: Rows waiting to be written, at most (each holds its run's summary and timeline, in memory and journal).
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
    """The ledger's journal and file writer (either may be absent). ``ledger``: the ``RunLedger``."""

    def __init__(self, ledger: Any, state_dir: str | None, threaded: bool, interval_s: float) -> None:
        self._ledger = ledger
        self._interval = interval_s
        self._last_kick = -math.inf
        self.journal: Journal | None = None
        self._jw: JournalWriter | None = None
        self.writer: FileWriter | None = None
        self.gap_pending = False
        self._gap_since: float | None = None
        self._errors_log = RateLimitedLog(log, period_s=300.0)  # a failing disk fails every checkpoint
        if state_dir is not None:
            try:
                self.journal = Journal(state_dir)
            except OSError as exc:
                log.error("run ledger: cannot use the state directory %s (%s): open runs will not survive a "
                          "restart", state_dir, exc)
        if ledger.csv_path is not None:
            self.writer = FileWriter(ledger.csv_path, on_written=self._written, on_failed=self._failed,
                                     journaled=self._journaled if self.journal is not None else None,
                                     clock=ledger._clock, threaded=threaded)
        if self.journal is not None:
            state = self.journal.load()
            if state is not None:
                self._restore(state)
            self._jw = JournalWriter(self.journal, self._build, self._journal_failed)
            self._last_kick = ledger._clock()
            self._jw.kick()  # a new generation at once: the journal read is compacted

    # -- checkpoints -------------------------------------------------------------------------------

    def _build(self) -> bytes:
        led = self._ledger
        with led._lock:
            state = {
                "format": FORMAT,
                "clock": led._clock if isinstance(led._clock, SteadyClock) else None,
                "saved_wall": time.time(),
                "active": [r for r in led._active.values() if not r.tentative],
                "pending": [row.journaled() for row in led._pending.values()],
                "frame": led._history[-1] if led._history else None,
                "seq": led._seq,
                "finished_counts": dict(led._finished_counts),
            }
            for run in state["active"]:
                run.live_memo = run.settled_memo = None  # caches: not worth the bytes
            return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def _journaled(self, ticket: int, timeout: float) -> bool:
        return self._jw is None or self._jw.wait(ticket, timeout)

    def _journal_failed(self, exc: OSError) -> None:
        led = self._ledger
        with led._lock:
            led._write_errors += 1
            led._version += 1
        self._errors_log.error("journal", "run ledger: cannot write the journal in %s (%s); open runs may not "
                               "survive a restart", self.journal.directory if self.journal else "?", exc)

    def _restore(self, state: dict[str, Any]) -> None:
        led = self._ledger
        journaled_clock = state.get("clock")
        same_axis = (isinstance(led._clock, SteadyClock) and isinstance(journaled_clock, SteadyClock)
                     and led._clock.adopt(journaled_clock))
        now = led._clock()
        frame: Frame | None = state.get("frame")
        if frame is not None and frame.t >= now:
            log.warning("run ledger: the journal's last snapshot is dated after now (the machine rebooted with "
                        "its clock behind?): the downtime's energy is not counted")
            frame = None
        for run in state.get("active", ()):
            run.restored = {}
            run.last_point_received = now  # it gets --runs.stale-after from now to push again
            run.checkpoints = deque()
            run.alive_checkpoint = run.acc.copy()
            run.live_memo = run.settled_memo = None
            led._active[run.run_id] = run
        if frame is not None and led._active:
            led._history.append(frame)
            self.gap_pending = True
        for row in state.get("pending", ()):
            row.extra["queued"] = now
            led._pending[row.seq] = row
            if self.writer is not None:
                self.writer.submit(row)
        led._seq = max(led._seq, int(state.get("seq", 0)))
        for status, count in state.get("finished_counts", {}).items():
            led._finished_counts[status] = max(led._finished_counts.get(status, 0.0), count)
        led._holders_gen += 1
        led._version += 1
        log.info("run ledger: restored %d open run(s) and %d row(s) still to write from the journal in %s%s",
                 len(led._active), len(led._pending), self.journal.directory if self.journal else "?",
                 "" if same_axis else " (another boot: the downtime is measured by the wall clock)")

    # -- the gap -------------------------------------------------------------------------------------

    def gap_ready(self, prev: Frame, frame: Frame) -> bool:
        """Whether the first snapshot after a restart can close the gap: every GPU whose counter the
        journaled snapshot had is readable again (or ``GAP_WAIT_S`` passed)."""
        if self._gap_since is None:
            self._gap_since = frame.t
        if frame.t - self._gap_since > GAP_WAIT_S:
            return True
        return all(g.energy_j is not None for k, g in frame.gpus.items()
                   if k in prev.gpus and prev.gpus[k].energy_j is not None) and \
            all(k in frame.gpus for k, g in prev.gpus.items() if g.energy_j is not None)

    def note_gap(self, prev: Frame, frame: Frame) -> None:
        """The restart's gap (``prev``: the journaled snapshot, ``frame``: the first one since) is about to be
        counted as one interval: each restored run says so."""
        self.gap_pending = False
        gap = frame.t - prev.t
        for run in self._ledger._active.values():
            if run.restored is None:
                continue
            run.notes.append(f"the exporter restarted during the run: gap_s={gap:.1f}, the gap's energy is the "
                             "increase of the GPU energy counter across it, shared as before the gap")
            for key in run.gpus:
                g0, g1 = prev.gpus.get(key), frame.gpus.get(key)
                if g0 is not None and g1 is not None and g0.energy_j is not None and (
                        g1.energy_j is None or g1.energy_j < g0.energy_j):
                    run.notes.append("the GPU energy counter went back across the restart (driver reload?): "
                                     "the gap's energy is missing")
                    break

    # -- rows ----------------------------------------------------------------------------------------

    def started(self) -> None:
        """A run started (ledger lock held): journal it now, not at the next periodic checkpoint."""
        if self._jw is not None:
            self._jw.kick()

    def closed(self, row: Row) -> None:
        """A run closed (ledger lock held): journal it, then hand it to the writer."""
        row.extra["queued"] = self._ledger._clock()
        if self._jw is not None:
            row.ticket = self._jw.kick()
            self._last_kick = self._ledger._clock()
        if self.writer is not None:
            self.writer.submit(row)
        led = self._ledger
        if len(led._pending) > MAX_PENDING:  # a file system down for days: memory and journal stay bounded
            oldest = min(led._pending)
            dropped = led._pending.pop(oldest)
            if self.writer is not None:
                self.writer.discard(oldest)
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
        if row.failures:
            log.warning("run %s: written to the run ledger after %d failed attempt(s)", row.run_id, row.failures)
        if self._jw is not None:
            self._jw.kick()  # the row leaves the journal

    def _failed(self, row: Row, exc: OSError, first: bool) -> None:
        led = self._ledger
        with led._lock:
            led._write_errors += 1
            led._version += 1
        if first:
            log.error("run %s: cannot write the run ledger (%s: %s); the run is kept%s and retried until it is "
                      "written. Check that the directory of --runs.csv exists and is writable.",
                      row.run_id, getattr(exc, "filename", None) or led.csv_path, exc.strerror or exc,
                      " in the journal" if self.journal is not None else "")

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
        if self._jw is not None and now - self._last_kick >= self._interval:
            self._last_kick = now
            self._jw.kick()

    def shutdown(self) -> None:
        """The last checkpoint and the rows still to write, each within its time; what is not written stays
        in the journal."""
        if self._jw is not None:
            self._jw.wait(self._jw.kick(), SHUTDOWN_JOURNAL_S)
        if self.writer is not None:
            self.writer.drain(SHUTDOWN_FILES_S)
            self.writer.close()
        if self._jw is not None:
            self._jw.wait(self._jw.kick(), SHUTDOWN_JOURNAL_S / 2)
            self._jw.close()
