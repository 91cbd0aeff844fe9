"""The run ledger's note on a run whose GPU reported a critical Xid while it ran.

A GPU that fell off the bus (Xid 79) or hit an uncorrectable memory error (48, 94, 95) or an NVLink error
(74) may still draw power, and the run's energy and J/token then include a GPU that did no useful work, or
lose one that stopped answering; the note says so on the run's row. Xids up to ``GRACE_S`` after the run's
last point count too: a run killed by an Xid stops pushing before the exporter hears of it.

Pure: plain values in (the run's GPU keys and times, the snapshot's recent critical Xids), text out. It
never reads a clock, a snapshot or a file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpu_energy_exporter.core.health import CRITICAL_XIDS, XidEvent
from gpu_energy_exporter.ledger.files import iso_utc
from gpu_energy_exporter.ledger.snapshot_frames import uuid_key

#: Seconds after the run's end in which a critical Xid is still the run's.
GRACE_S = 60.0


def xid_notes(gpu_keys: Iterable[str], start: float, end: float, xids: Sequence[XidEvent]) -> list[str]:
    """One note per GPU of the run (``gpu_keys``: ``frames.uuid_key`` of its GPUs) with a critical Xid in
    [start, end + GRACE_S]."""
    keys = set(gpu_keys)
    by_gpu: dict[str, list[XidEvent]] = {}
    for e in xids:
        if e.critical and uuid_key(e.gpu_uuid) in keys and start <= e.t <= end + GRACE_S:
            by_gpu.setdefault(e.gpu_uuid, []).append(e)
    notes = []
    for uuid, events in sorted(by_gpu.items(), key=lambda kv: kv[1][0].gpu_index):
        first = events[0]
        codes: dict[int, int] = {}
        for e in events:
            codes[e.xid] = codes.get(e.xid, 0) + 1
        listed = ", ".join(f"{code} ({CRITICAL_XIDS[code]})" + (f" x{n}" if n > 1 else "")
                           for code, n in sorted(codes.items()))
        when = (f"first at {iso_utc(first.t)}" if first.t <= end
                else f"at {iso_utc(first.t)}, {first.t - end:.0f}s after the run's last point (it may have ended "
                     "the run)")
        notes.append(f"GPU {first.gpu_index} ({uuid}) reported critical Xid {listed}, {when}: the run's energy "
                     "and J/token may count a failed GPU; drain the node and reset the GPU before reusing it")
    return notes
