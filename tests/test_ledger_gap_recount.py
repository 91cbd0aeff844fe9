"""A run restored after a long restart, recounted from a moment a hair before the first snapshot since
(``ledger.runs.rewind``): plain frames and a run, no ledger, no sampler, no clock.

The restored run's only checkpoint is its state saved before the restart; the saved snapshot leaves the
history as soon as the first snapshot since closes the gap (the gap is longer than the history). The next
counter read settles a span that begins at that first snapshot's read, dated on the ledger's clock a few
microseconds before or after the snapshot itself. Before the fix, a span beginning before it (and no push
since the restart to move the run's alive checkpoint) recounted the run from the saved state through a history
that no longer had the gap: the gap's energy (hours of a GPU's counter) was lost, about one run in five in
``test_ledger_upgrade`` on a loaded machine. A span beginning after it recounted exactly; one beginning before
it, once the run had pushed, recounted nothing and noted an approximate split.
"""

from __future__ import annotations

import math
from collections import deque

import pytest

from gpu_energy_exporter.ledger import runs
from gpu_energy_exporter.ledger.snapshot_frames import Frame, GPUFrame
from gpu_energy_exporter.ledger.split import Holding

WATTS = 300.0
T0 = 1000.0  # the snapshot saved at the restart
GAP_S = 16000.0


def _frame(t: float) -> Frame:
    g = GPUFrame(uuid="GPU-a", name="NVIDIA H100 80GB HBM3", energy_j=WATTS * t, power_w=WATTS,
                 memory_used=1 << 30, memory_total=80 << 30, idle_w=None, idle_source="flag", index=0)
    return Frame(t, {"a": g}, {}, None, None, None)


def _holders(frame: Frame) -> dict[str, list[Holding]]:
    return {"a": [Holding("r", T0 - 10.0)]}


def _restored_run(pushed_since: bool) -> tuple[runs.Run, list[Frame]]:
    """The run as ``ledger.restart`` restores it (checkpoints emptied, its saved state the alive checkpoint),
    advanced over the gap and two snapshots since, the saved snapshot gone from the history."""
    run = runs.Run("r", T0 - 10.0, 0.0, True, 16, T0 - 10.0)
    run.tentative = False
    run.gpus = {"a": "GPU-a"}
    run.acc.t, run.acc.energy_j = T0, WATTS * 10.0
    run.last_point_t = T0 - 1.0
    run.restored = {}
    run.checkpoints = deque()
    run.alive_checkpoint = run.acc.copy()
    f0, f1, f2, f3 = _frame(T0), _frame(T0 + GAP_S), _frame(T0 + GAP_S + 0.2), _frame(T0 + GAP_S + 2.0)
    history = [f0]
    for prev, frame in ((f0, f1), (f1, f2), (f2, f3)):
        history.append(frame)
        if prev is f0:
            history.pop(0)  # older than the history's window: gone at once
        if pushed_since and prev is f1:
            run.last_point_t = f2.t + 0.1
        runs.advance(run, prev, frame, _holders, 120.0)
    return run, history


@pytest.mark.parametrize("pushed_since", [False, True], ids=["before-the-first-push", "after-it"])
@pytest.mark.parametrize("offset", [-5e-6, 0.0, 5e-6], ids=["span-just-before", "at", "just-after"])
def test_a_restored_run_recounted_from_the_first_snapshot_since_keeps_the_gaps_energy(
        pushed_since: bool, offset: float) -> None:
    run, history = _restored_run(pushed_since)
    end = history[-1].t
    whole = WATTS * (end - (T0 - 10.0))
    assert run.acc.energy_j == pytest.approx(whole), "counted over the gap by the counter"
    runs.rewind(run, history[0].t + offset, history, _holders)
    assert run.acc.t == end
    assert run.acc.energy_j == pytest.approx(whole), "the gap's energy kept"
    assert not run.notes, "recounted from the first snapshot since: nothing approximate"


def test_a_new_run_backdated_before_the_history_is_replayed_from_its_start_as_before() -> None:
    """A checkpoint at the run's start counted nothing before the history: recounted from it as ever."""
    run = runs.Run("r", T0 - 10.0, 0.0, True, 16, T0)
    run.tentative = False
    run.gpus = {"a": "GPU-a"}
    history = [_frame(T0), _frame(T0 + 1.0), _frame(T0 + 2.0)]
    runs.replay(run, run.acc, history, run.s, math.inf, _holders, live=True)
    runs.rewind(run, T0 - 5.0, history, _holders)
    assert run.acc.t == T0 + 2.0 and run.acc.energy_j == pytest.approx(WATTS * 2.0)
    # nothing approximate in the recount; what is not charged (the 10 s before the history) is said
    assert run.notes == ["started 10.0s before the exporter's first snapshot: that part is not charged"]
