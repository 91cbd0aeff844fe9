"""The run ledger's journal: the open runs and the rows not yet written, kept so that they outlive the
exporter (a restart, a SIGKILL, a node drain), and the steady clock the ledger's times are on.

Modelled on a write-ahead log: every checkpoint is one record appended to ``journal-<gen>.log`` in the state
directory and fsynced before it counts; a record is ``length, crc32, payload`` so a torn tail (the process
killed mid-append) is recognised and ignored. A checkpoint is the whole state (it replaces, never patches,
the one before), so compaction is a rotation: when the file has grown past a few checkpoints, the newest
state is written to ``journal-<gen+1>.log`` (temporary file, fsync, rename, fsync of the directory) and the
older generation is removed. No file is ever rewritten in place. Loading reads the newest generation's last
complete record.

The payload is a pickle: the journal is private to the exporter (its directory is created 0700), never an
interchange format, and holds the ledger's own objects; a record that does not load (another version of the
exporter) is logged and the ledger starts empty, the CSV and JSON summaries untouched.

``JournalWriter`` is the journal's own thread: callers hand it the newest payload and never wait on the
disk (a stalled file system shows as a backlog, not as frozen sampling). Nothing here knows about runs.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_energy_exporter.ledger.files import fsync_dir

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">II")  # payload length, crc32 of the payload
_PREFIX = "journal-"
_SUFFIX = ".log"
#: Rotate (compact) once the current file holds this many times the newest checkpoint's size.
_ROTATE_FACTOR = 4
#: Version of the payload's layout; another one is not loaded.
FORMAT = 1


def boot_id() -> str:
    """This boot of the machine (``CLOCK_MONOTONIC`` is comparable between processes of one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(slots=True)
class SteadyClock:
    """Seconds on the monotonic clock, shown as Unix time: ``wall_anchor + monotonic() - mono_anchor``.

    A step of the wall clock (NTP, an operator, a VM resumed) never moves it, so intervals and durations
    measured on it are true; the anchors are journaled, and a restart on the same boot keeps them, so times
    before and after the restart are on one axis (the downtime is measured, not guessed)."""

    wall_anchor: float
    mono_anchor: float
    boot: str

    @classmethod
    def start(cls) -> SteadyClock:
        return cls(time.time(), time.monotonic(), boot_id())

    def __call__(self) -> float:
        return self.wall_anchor + (time.monotonic() - self.mono_anchor)

    def adopt(self, other: SteadyClock) -> bool:
        """Continue ``other`` (a journaled clock) when it comes from this boot: the axis carries on."""
        if not other.boot or other.boot != self.boot:
            return False
        self.wall_anchor, self.mono_anchor = other.wall_anchor, other.mono_anchor
        return True


def _generations(directory: str) -> list[int]:
    gens = []
    for name in os.listdir(directory):
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            try:
                gens.append(int(name[len(_PREFIX):-len(_SUFFIX)]))
            except ValueError:
                continue
    return sorted(gens)


def _path(directory: str, gen: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{gen:08d}{_SUFFIX}")


def record(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def last_record(path: str) -> tuple[bytes | None, int]:
    """The last complete record's payload in ``path`` and the offset where complete records end."""
    last: bytes | None = None
    good = 0
    with open(path, "rb") as f:
        while True:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                break
            size, crc = _HEADER.unpack(head)
            payload = f.read(size)
            if len(payload) < size or zlib.crc32(payload) != crc:
                break  # a torn tail: the process died while appending
            last, good = payload, f.tell()
    return last, good


def clean_temp_files(directory: str) -> int:
    """Remove the temporary files an interrupted atomic write left in ``directory`` (``.<name>.*.tmp``, ours
    only); how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if name.startswith(".") and name.endswith(".tmp"):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError as exc:
                log.warning("run ledger: cannot remove the stale temporary file %s (%s)", name, exc)
    return removed


class Journal:
    """The journal files in ``directory`` (created 0700). Not thread-safe: one writer (``JournalWriter``)."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        clean_temp_files(self.directory)
        gens = _generations(self.directory)
        self._gen = gens[-1] if gens else 0
        self._size = 0
        self._file: Any = None

    def load(self) -> Any | None:
        """The newest checkpoint (None when there is none or it does not load)."""
        for gen in reversed(_generations(self.directory)):
            path = _path(self.directory, gen)
            try:
                payload, good = last_record(path)
                if payload is None:
                    continue
                state = pickle.loads(payload)  # noqa: S301 - our own private file, see the module docstring
            except Exception as exc:  # noqa: BLE001 - a bad journal must not stop the exporter
                log.error("run ledger: cannot read the journal %s (%s); starting without its runs", path, exc)
                return None
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                log.error("run ledger: the journal %s is from another version; starting without its runs", path)
                return None
            self._gen = gen
            self._size = good
            return state
        return None

    def append(self, payload: bytes) -> None:
        """Append one checkpoint and fsync it; rotate into a new generation when the file has grown."""
        data = record(payload)
        if self._file is None or self._size > _ROTATE_FACTOR * len(data) + (1 << 20):
            self._rotate(data)
            return
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._size += len(data)

    def _rotate(self, data: bytes) -> None:
        old = [g for g in _generations(self.directory)]
        gen = self._gen + 1
        path = _path(self.directory, gen)
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.directory)
        if self._file is not None:
            self._file.close()
        self._file = open(path, "ab")  # noqa: SIM115 - kept open between appends
        self._gen, self._size = gen, len(data)
        for g in old:
            try:
                os.unlink(_path(self.directory, g))
            except OSError:
                pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JournalWriter:
    """The journal's thread: writes the newest payload ``build()`` returns whenever ``kick()`` was called
    (older ones are superseded, never queued). ``build`` runs on this thread and returns bytes (or None for
    nothing to write)."""

    def __init__(self, journal: Journal, build: Callable[[], bytes | None],
                 on_error: Callable[[OSError], None]) -> None:
        self._journal = journal
        self._build = build
        self._on_error = on_error
        self._cond = threading.Condition()
        self._wanted = 0
        self._done = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ledger-journal", daemon=True)
        self._thread.start()

    def kick(self) -> int:
        """Ask for a checkpoint; returns its ticket for ``wait``."""
        with self._cond:
            self._wanted += 1
            self._cond.notify_all()
            return self._wanted

    def wait(self, ticket: int, timeout: float) -> bool:
        """Whether the checkpoint ``ticket`` (or a later one) is on disk within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done < ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = 0.5) -> None:
        """Stop the thread once the checkpoints asked for are written (waiting at most ``timeout`` s: a
        stalled disk keeps it, a daemon thread, and the process exits anyway)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            self._journal.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._done >= self._wanted and not self._stop:
                    self._cond.wait()
                if self._done >= self._wanted:
                    return
                ticket = self._wanted
            try:
                payload = self._build()
                if payload is not None:
                    self._journal.append(payload)
            except OSError as exc:
                self._on_error(exc)
                time.sleep(1.0)  # a failing disk: try again later, not in a tight loop
                continue
            except Exception:  # noqa: BLE001 - the thread must outlive a bug in one checkpoint
                log.exception("run ledger: journal checkpoint failed")
            with self._cond:
                self._done = max(self._done, ticket)
                self._cond.notify_all()
