"""The run ledger's files: the runs CSV and the JSON summaries beside it, written atomically, and the
back-off of writes that failed.

Readers (``runs``, ``report``, a spreadsheet) never see half a file: a JSON summary goes to a temporary file
in the same directory, is fsynced and renamed over the old one; a CSV row is appended and fsynced (a torn
last line, from a crash mid-append, is cut off before the next row). These
functions take plain values (a path, a row, a document) and raise ``OSError``; the ledger decides what a
failure means (keep the run, retry later). Nothing here knows about runs, snapshots or locks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import IO, Any

from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.core.textfmt import csv_cell, csv_record, json_safe

log = logging.getLogger(__name__)

# Back-off of failed ledger writes: 5 s, doubling, at most 5 minutes.
_RETRY_FIRST_S = 5.0
_RETRY_MAX_S = 300.0

#: The directory of the JSON summaries, relative to the CSV's.
RUNS_DIR = "runs"


def atomic_write(path: str, write: Callable[[IO[bytes]], object], mode: int | None = None) -> None:
    """Write a file so that readers see either the old content or the new, never a mix.

    ``write`` fills a temporary file in the same directory; it is flushed, fsynced and renamed over
    ``path``, then the directory is fsynced so the rename survives a power cut. If ``write`` raises,
    the temporary file is removed and ``path`` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            try:
                mode = os.stat(path).st_mode & 0o777
            except FileNotFoundError:
                mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (fsync the directory; a file system that refuses is left be)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def _csv_line(values: Iterable[str]) -> bytes:
    return csv_record(values).encode("utf-8")


HEADER_LINE: bytes = _csv_line(COLUMN_NAMES)


def append_csv_row(path: str, row: Mapping[str, Any], clock: Callable[[], float] = time.time) -> None:
    """Append one row to the ledger CSV, writing the header for a new file.

    Appended (``O_APPEND``) and fsynced, never the whole file rewritten: the cost and the memory of a row do
    not grow with the file, and it needs free space for one line. A torn last line (the process killed
    mid-append) is cut off before the row is added (``repair_tail``). A file whose header is not ours is
    renamed aside (``<path>.<time>.old``, with a warning), never appended to or overwritten.
    """
    line = csv_line(row)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and not _our_header(path):
            os.close(fd)
            fd = -1
            _move_aside(path, clock)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            size = 0
        if size:
            size = repair_tail(path, fd, size)
        data = (HEADER_LINE if size == 0 else b"") + line
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        os.fsync(fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
            fd = -1
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def csv_line(row: Mapping[str, Any]) -> bytes:
    """One CSV line of a run's summary (every cell through ``format_csv_value``)."""
    return _csv_line(format_csv_value(row.get(name)) for name in COLUMN_NAMES)


def _our_header(path: str) -> bool:
    with open(path, "rb") as f:
        first = f.read(len(HEADER_LINE) + 2)
    return first.split(b"\n", 1)[0].rstrip(b"\r") + b"\n" == HEADER_LINE


def _move_aside(path: str, clock: Callable[[], float]) -> None:
    stamp = utc_stamp(clock())
    aside = f"{path}.{stamp}.old"
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.{stamp}-{n}.old"
    os.replace(path, aside)
    log.warning("runs CSV %s has a different header (another tool's file or an older ledger version); moved "
                "it to %s and started a new file", path, aside)


#: How much of the CSV's end is read to repair a torn line or to find a row already written.
TAIL_BYTES = 256 * 1024


def _tail(path: str, size: int) -> tuple[int, bytes]:
    start = max(0, size - TAIL_BYTES)
    with open(path, "rb") as f:
        f.seek(start)
        return start, f.read(size - start)


def repair_tail(path: str, fd: int, size: int) -> int:
    """Make the CSV end at a line break before a row is appended; the new size. A torn last line within the
    last ``TAIL_BYTES`` (a write interrupted by a crash: the row is still pending and written again) is cut
    off. A longer one is no row of the ledger's: it is kept and closed with a line break (and a quote, when
    it left one open), so that the rows after it start a line of their own for every CSV reader."""
    start, tail = _tail(path, size)
    if tail.endswith(b"\n"):
        return size
    cut = tail.rfind(b"\n")
    if cut < 0 and start > 0:
        return _isolate(path, fd, size)
    new_size = start + cut + 1
    log.warning("runs CSV %s: removed a half-written last line (%d bytes) left by an interrupted write",
                path, size - new_size)
    os.ftruncate(fd, new_size)
    return new_size


def _isolate(path: str, fd: int, size: int) -> int:
    """Close the CSV's last line (longer than ``TAIL_BYTES``) with a line break, after a quote when it has an
    odd number of them; read backwards a chunk at a time (memory stays bounded, whatever its length)."""
    quotes = 0
    pos = size
    length = 0
    with open(path, "rb") as f:
        while pos > 0:
            step = min(TAIL_BYTES, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            nl = chunk.rfind(b"\n")
            part = chunk[nl + 1:] if nl >= 0 else chunk
            quotes += part.count(b'"')
            length += len(part)
            if nl >= 0:
                break
    closing = b'"\n' if quotes % 2 else b"\n"
    written = 0
    while written < len(closing):
        written += os.write(fd, closing[written:])
    log.warning("runs CSV %s: its last line (%d bytes, no row of the ledger's) was left unfinished; closed it with "
                "a line break so that the next rows stay readable", path, length)
    return size + len(closing)


def row_written(path: str, row: Mapping[str, Any]) -> bool:
    """Whether this exact row is among the CSV's last lines (a row the database still had as unexported, whose
    append had completed when the process died): appending it again would count the run twice."""
    try:
        size = os.stat(path).st_size
        if not size:
            return False
        _, tail = _tail(path, size)
    except FileNotFoundError:
        return False
    return csv_line(row) in tail


def format_csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return ""
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    if isinstance(value, int):
        return str(value)
    return csv_cell(str(value))  # run ids and labels come over OTLP: never a formula in a spreadsheet


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def summary_filename(run_id: str) -> str:
    """A file name for a run id (any characters may come over OTLP)."""
    name = _SAFE_NAME.sub("_", run_id).strip("._") or "run"
    return name[:120] + ".json"


def iso_utc(t: float | None) -> str | None:
    if t is None:
        return None
    text = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")



def utc_stamp(t: float) -> str:
    """``20231114T221320Z``: a time in a file name."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def retry_delay(failures: int) -> float:
    """Seconds to wait before writing again after ``failures`` failed attempts (at least 1)."""
    return min(_RETRY_MAX_S, _RETRY_FIRST_S * 2 ** min(failures - 1, 16))


def check_writable(path: str) -> str | None:
    """None when the runs CSV ``path`` and its summaries directory can be written, else one line saying
    what is wrong and what to do. Creates the directories, writes nothing else."""
    try:
        directory = os.path.dirname(os.path.abspath(path))
        runs_dir = os.path.join(directory, RUNS_DIR)
        os.makedirs(runs_dir, exist_ok=True)
        for d in (directory, runs_dir):
            fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=d)
            os.close(fd)
            os.unlink(tmp)
        if os.path.isdir(path):
            raise IsADirectoryError(21, "is a directory", path)
    except OSError as exc:
        return (f"--runs.csv {path}: cannot write there ({getattr(exc, 'filename', None) or path}: "
                f"{exc.strerror or exc}). Finished runs stay in memory and are retried until it works; "
                "point --runs.csv at a writable file or fix the directory.")
    return None


def summaries_dir(csv_path: str) -> str:
    """The directory of the JSON summaries beside the runs CSV ``csv_path``, created if missing."""
    runs_dir = os.path.join(os.path.dirname(os.path.abspath(csv_path)), RUNS_DIR)
    os.makedirs(runs_dir, exist_ok=True)
    return runs_dir


def summary_name(runs_dir: str, run_id: str, written: str | None, start: float) -> tuple[str, bool]:
    """The file name of a run's JSON summary in ``runs_dir`` and whether it differs from the usual one.

    ``written``: the name already written for this run (a retried write keeps it). The same run id again
    (resumed, or reused) keeps the earlier summary: the new one gets the run's start time in its name."""
    name = written or summary_filename(run_id)
    if written is None and os.path.exists(os.path.join(runs_dir, name)) \
            and _start_of(os.path.join(runs_dir, name)) != start:
        return name[: -len(".json")] + f".{utc_stamp(start)}.json", True
    return name, False


def _start_of(path: str) -> float | None:
    """The run start a summary file records (the same run written again after a restart keeps its name)."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    start = doc.get("start_unix") if isinstance(doc, dict) else None
    return float(start) if isinstance(start, (int, float)) else None


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write a JSON document atomically (indented, NaN and infinities as null)."""
    payload = (json.dumps(json_safe(doc), indent=2, sort_keys=False, allow_nan=False) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(payload))
