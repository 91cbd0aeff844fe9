"""The run ledger's steady clock, and the file layout of the journal the releases before the database kept.

``SteadyClock`` is the time every figure of the ledger is on (the wall clock moved by the monotonic one, its
anchors saved with the state so that a restart on the same boot continues the axis).

Up to release 450c1b4 the ledger kept its open runs in ``journal-<gen>.log`` files in the state directory:
records of ``length, crc32, payload``, the payload a pickle of the whole state. ``legacy_journal`` and
``last_record`` read that layout (never the payload: ``ledger.migrate`` does, once, to move the state into the
database). Nothing here writes a journal any more, and nothing here unpickles.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">II")  # payload length, crc32 of the payload
_PREFIX = "journal-"
_SUFFIX = ".log"
#: The payload layout's version those releases wrote (the state dict's ``format``).
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


def legacy_journal(directory: str) -> list[str]:
    """The journal files a release before the database left in ``directory``, newest generation first."""
    try:
        return [_path(directory, gen) for gen in reversed(_generations(directory))]
    except OSError:
        return []


def record(payload: bytes) -> bytes:
    """One record of that layout (the tests make old journals with it)."""
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
