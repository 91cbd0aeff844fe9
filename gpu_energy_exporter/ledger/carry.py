"""Settlement across an exporter restart: what the ledger saves of each GPU's last counter read, and how the
first counter read after the restart settles the span from that read to itself.

Between two counter reads a run's energy is provisional (``ledger.settlement``). A restart loses the snapshot
history and the counters' last reads: without this module, the part since the last read before the restart
stayed the power readings' estimate, and /metrics served no settled counter for the run until the next read.
So each checkpoint (``ledger.restart``, on the store's thread) saves a ``Carry``: per GPU its last counter read
(when, on the ledger's clock; the total the frames count in; the driver's own counter value), the newest
snapshot frame that every GPU's counter read had settled, and each open run's figures as of that frame. At
restore they are put back (``apply``): the frame at the head of the history, the figures as the runs' one
checkpoint, the reads as the ledger's last reads; so the runs' settled counters are served again at once.

The first counter read of a GPU after the restart (``across``) settles the whole span since the saved read:
the counter's delta (the driver's counter keeps counting while the exporter is down) spread by time over the
saved frames inside the span (the power readings' shape is not known across the downtime), and the runs
holding the GPU recounted from the saved read, so they are charged exactly the counter's delta over the span,
split as every interval is (who holds the GPU at each frame). A counter lower than the saved one was reset (a
driver reload, a reboot): nothing is settled across the gap, the part before the restart stays estimated, and
a note and a log line say how many seconds of the GPU's energy went uncharged.

Never reads hardware, never does I/O; called with the ledger's lock held.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import MutableSequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_energy_exporter.ledger import runs, settlement
from gpu_energy_exporter.ledger.accounting import Acc
from gpu_energy_exporter.ledger.snapshot_frames import Frame

log = logging.getLogger(__name__)

#: Two instants on the frame clock closer than this are one.
EPS_S = 1e-3
#: Frames saved from the settled one on, at most (a counter unread for long: the oldest and the newest are kept;
#: the runs' live figures between are then interpolated over the gap in the saved frames).
MAX_FRAMES = 64


@dataclass(slots=True)
class GPUAnchor:
    """A GPU's last counter read: when (ledger clock), the total the frames count in (``GPUFrame.energy_j``),
    and the driver's counter value (J; None when not known: nothing is settled across then)."""

    t: float
    energy_j: float
    counter_j: float | None
    uuid: str = ""


@dataclass(slots=True)
class Carry:
    """What a restart needs to settle across it (saved with every checkpoint)."""

    #: the newest frame not after any GPU's last read (settled on every GPU) and those after it, but the last
    #: (saved on its own as ``frame``): the span's shape, and what the runs' live figures are cut from
    frames: list[Frame] = field(default_factory=list)
    anchors: dict[str, GPUAnchor] = field(default_factory=dict)  # GPU key -> its last counter read
    bases: dict[str, Acc] = field(default_factory=dict)  # run id -> its figures as of ``frame.t``


def capture(history: MutableSequence[Frame]) -> Carry:
    """The GPUs' last reads (as the newest frame has them) and the newest frame settled on all of them."""
    if not history:
        return Carry()
    latest = history[-1]
    anchors = {key: GPUAnchor(latest.t + g.span.anchor_dt, g.span.anchor_j, g.span.anchor_counter_j, g.uuid)
               for key, g in latest.gpus.items() if g.span is not None}
    if not anchors:
        return Carry()
    first = min(a.t for a in anchors.values())
    i = next((i for i in range(len(history) - 1, -1, -1) if history[i].t <= first + EPS_S), None)
    if i is None or i == len(history) - 1:
        return Carry()  # no frame settled on every GPU; or the newest is: nothing to settle across
    frames = [history[j] for j in range(i, len(history) - 1)]
    if len(frames) > MAX_FRAMES:
        frames = [frames[0], *frames[len(frames) - MAX_FRAMES + 1:]]
    return Carry(frames, anchors)


def settled_at(state: Carry) -> float | None:
    """When the carry's settled frame was taken (the runs' figures are saved as of it), None without one."""
    return state.frames[0].t if state.frames else None


def base(run: runs.Run, t: float, history: MutableSequence[Frame], holders: runs.Holders) -> Acc:
    """``run``'s figures as of ``t`` (its last checkpoint before it, the history replayed up to it)."""
    before = run.checkpoint_before(t)
    acc = before.copy() if before is not None else Acc(t=run.s)
    if acc.t < t:
        runs.replay(run, acc, history, max(acc.t, run.s), t, holders, live=False)
    acc.t = t
    return acc


def apply(carry: Any, ledger: Any, frame: Frame) -> dict[str, GPUAnchor]:
    """Put a restored ``carry`` back into ``ledger`` (whose history holds the restored ``frame``): the saved
    frames before it in the history, each run's figures as of it as its checkpoint, the GPUs' last reads.
    Returns the reads still to settle across (GPU key -> its last read); none when the carry does not fit."""
    if not isinstance(carry, Carry) or not carry.frames or not carry.anchors:
        return {}
    frames = [f for f in carry.frames if isinstance(f, Frame)]
    times = [f.t for f in frames] + [frame.t]
    if len(frames) != len(carry.frames) or any(b <= a for a, b in zip(times, times[1:], strict=False)):
        return {}  # not the frames that led to the restored one
    ledger._history.extendleft(reversed(frames))
    for run_id, acc in carry.bases.items():
        run = ledger._active.get(run_id)
        if run is not None and isinstance(acc, Acc) and acc.t <= run.acc.t:
            run.checkpoints = deque([acc])
    ledger._anchors.update({key: a.t for key, a in carry.anchors.items()})
    return dict(carry.anchors)


def across(ledger: Any, key: str, frame: Frame, anchor: GPUAnchor) -> bool:
    """``frame`` read GPU ``key``'s counter for the first time since the restart (``anchor``: its last read
    before it). False when the read closes the span from ``anchor`` itself (the GPU collector outlived the
    ledger): ordinary settlement does it. Else settles the span across the restart (or, across a counter
    reset, says what was lost) and recounts the runs holding the GPU from ``anchor``; True."""
    g = frame.gpus[key]
    span = g.span
    assert span is not None
    if span.closed is not None and abs(frame.t + span.closed[0] - anchor.t) <= EPS_S:
        return False
    t1, c1, c0 = frame.t + span.anchor_dt, span.anchor_counter_j, anchor.counter_j
    ledger._anchors[key] = t1
    history: MutableSequence[Frame] = ledger._history
    if c1 is None or c0 is None or t1 <= anchor.t + EPS_S:
        return True  # the driver's counter is not known on one side: the gap stays as counted
    holding = list(settlement.holding_since(ledger._active.values(), key, anchor.t, frame))
    if c1 < c0:
        before = max((f.t for f in history if f.t < frame.t), default=anchor.t)
        lost = max(0.0, frame.t - before)
        log.warning("run ledger: the energy counter of GPU %s went back across the restart (%.3f J, now %.3f J: a "
                    "driver reload or a reboot): %.1f s of GPU energy (the downtime) are charged to no run, and the "
                    "%.1f s before the restart stay the power readings' estimate", g.uuid, c0, c1, lost,
                    before - anchor.t)
        for run_id in holding:
            _note(ledger._active[run_id], f"the GPU energy counter went back across the restart (driver reload?): "
                  f"{lost:.1f}s of its energy (the downtime) are missing, the {before - anchor.t:.1f}s before the "
                  "restart are the power readings' estimate")
        return True
    # The frames count in the process's monotonic total; the driver's counter is the same across processes.
    offset = span.anchor_j - c1
    shift = offset - (anchor.energy_j - c0)
    for i in range(len(history) - 1):
        f = history[i]
        gf = f.gpus.get(key)
        if gf is None or gf.energy_j is None or f.t >= t1:
            continue
        if f.t <= anchor.t + EPS_S:
            energy = gf.energy_j + shift  # settled before the restart: onto this process's total
        else:
            energy = c0 + offset + (c1 - c0) * (f.t - anchor.t) / (t1 - anchor.t)
        history[i] = replace(f, gpus={**f.gpus, key: replace(gf, energy_j=energy, settled=True)})
    ledger._holders_gen += 1
    for run_id in holding:
        since = ledger._recount_from.get(run_id)
        ledger._recount_from[run_id] = anchor.t if since is None else min(since, anchor.t)
        _note(ledger._active[run_id], f"the exporter restarted during the run: the {t1 - anchor.t:.1f}s from the "
              "GPU's last counter read before it to the first one after it are settled across the restart by the "
              "counter")
    ledger._recount()  # now, while the runs' checkpoint at the saved read is still kept
    return True


def _note(run: runs.Run, note: str) -> None:
    if note not in run.notes:
        run.notes.append(note)
