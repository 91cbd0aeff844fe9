"""The run ledger's exports: closed runs' JSON summaries and CSV rows, written from the database off the hot
path.

A closed run becomes a ``Row`` (its summary and document, made under the ledger's lock); the ledger stores it
in its database (``ledger.store``) and hands it here. In production the rows are written by this module's own
thread, in order, each only once the database holds it (``journaled``): a crash before the write leaves the
row in the database, unexported, and it is written after the restart; a crash after the write but before the
database marked it exported is recognised by ``files.row_written`` (the CSV's tail is read), so no run is
written twice and neither a summary nor a row exists without the other. A failed write is retried with
back-off, the rows behind it wait (their order is the CSV's); the backlog is the ledger's ``writes_pending``
gauge.

Sampling, scrapes and shutdown never wait on this thread: a stalled file system (hung NFS) blocks only it.
Without a thread (``threaded=False``, the unit tests) ``poll`` writes the due rows on the caller's thread,
the same code. Nothing here knows about runs, snapshots or the ledger's lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.ledger import files

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Row:
    """A closed run waiting to be written: ``seq`` orders rows (the database's key), ``ticket`` the store's
    batch that holds it (0: none needed)."""

    seq: int
    run_id: str
    start: float
    summary: dict[str, Any]
    doc: dict[str, Any]
    json_name: str | None = None
    restored: bool = False  # came back from the database: its append may have completed before the crash
    ticket: int = 0
    failures: int = 0
    next_try: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class FileWriter:
    """Writes ``Row``s to ``csv_path`` and the summaries directory beside it.

    ``on_written(row)`` / ``on_failed(row, exc, first)`` are called after each attempt (from the writing
    thread); ``journaled(ticket, timeout)`` says whether the database holds a batch (None: no database).
    ``clock``: for the back-off."""

    def __init__(self, csv_path: str, *, on_written: Callable[[Row], None],
                 on_failed: Callable[[Row, OSError, bool], None],
                 journaled: Callable[[int, float], bool] | None = None, clock: Callable[[], float] = time.time,
                 threaded: bool = True) -> None:
        self.csv_path = csv_path
        self._on_written = on_written
        self._on_failed = on_failed
        self._journaled = journaled
        self._clock = clock
        self._queue: deque[Row] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._idle = True
        self._cleaned = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="ledger-files", daemon=True)
            self._thread.start()

    def submit(self, row: Row) -> None:
        with self._cond:
            self._queue.append(row)
            self._cond.notify_all()

    def discard(self, seq: int) -> None:
        """Forget a row not being written now (the backlog's bound)."""
        with self._cond:
            for row in self._queue:
                if row.seq == seq and (self._idle or row is not self._queue[0]):
                    self._queue.remove(row)
                    return

    def backlog(self) -> int:
        with self._cond:
            return len(self._queue) + (0 if self._idle else 1)

    def poll(self, now: float) -> None:
        """Without a thread: write the rows that are due, oldest first (all of them with ``now = inf``)."""
        if self._thread is not None:
            with self._cond:
                self._cond.notify_all()
            return
        while True:
            with self._cond:
                if not self._queue or self._queue[0].next_try > now:
                    return
                row = self._queue[0]
            if not self._write(row):
                return

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every submitted row to be written (retrying failed ones at once)."""
        if self._thread is None:
            self.poll(float("inf"))
            return not self._queue
        deadline = time.monotonic() + timeout
        with self._cond:
            for row in self._queue:
                row.next_try = 0.0
            self._cond.notify_all()
            while self._queue or not self._idle:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:  # at start, not at the first row: a crash's leftovers go even if no run closes
            self._clean(files.summaries_dir(self.csv_path))
        except OSError as exc:
            log.debug("run ledger: cannot look for stale temporary files yet (%s)", exc)
        while True:
            with self._cond:
                while not self._stop and (not self._queue or self._queue[0].next_try > self._clock()):
                    wait = (self._queue[0].next_try - self._clock()) if self._queue else None
                    self._cond.wait(None if wait is None else max(0.05, min(wait, 1.0)))
                if self._stop:
                    return
                row = self._queue[0]
                self._idle = False
            try:
                if self._journaled is not None and row.ticket and not self._journaled(row.ticket, 1.0):
                    continue  # never export what the database does not hold yet
                self._write(row)
            finally:
                with self._cond:
                    self._idle = True
                    self._cond.notify_all()

    def _clean(self, runs_dir: str) -> None:
        """Once, before the first write: temporary files an interrupted write left (on this thread: the
        directory may be on a file system that hangs)."""
        if self._cleaned:
            return
        self._cleaned = True
        from gpu_energy_exporter.ledger.journal import clean_temp_files

        removed = clean_temp_files(os.path.dirname(os.path.abspath(self.csv_path))) + clean_temp_files(runs_dir)
        if removed:
            log.warning("run ledger: removed %d temporary file(s) left by an interrupted write", removed)
        if os.path.isfile(self.csv_path):  # never opens a FIFO or a device (that could block)
            fd = os.open(self.csv_path, os.O_WRONLY | os.O_APPEND)
            try:
                size = os.fstat(fd).st_size
                if size:
                    files.repair_tail(self.csv_path, fd, size)
            finally:
                os.close(fd)

    def _write(self, row: Row) -> bool:
        try:
            runs_dir = files.summaries_dir(self.csv_path)
            self._clean(runs_dir)
            if row.json_name is None:
                name, renamed = files.summary_name(runs_dir, row.run_id, None, row.start)
                if renamed:  # the same run id again (resumed, or reused): the earlier summary is kept
                    row.summary["summary_file"] = row.doc["summary_file"] = os.path.join(files.RUNS_DIR, name)
                row.json_name = name
            files.write_json(os.path.join(runs_dir, row.json_name), row.doc)
            if not (row.restored and files.row_written(self.csv_path, row.summary)):
                files.append_csv_row(self.csv_path, row.summary, self._clock)
        except OSError as exc:
            row.failures += 1
            row.next_try = self._clock() + files.retry_delay(row.failures)
            self._on_failed(row, exc, row.failures == 1)
            return False
        with self._cond:
            if self._queue and self._queue[0] is row:
                self._queue.popleft()
        self._on_written(row)
        return True
