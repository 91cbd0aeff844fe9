"""What one accepted point does to its run: ``apply_point`` is the state machine of a point (a counter series,
a finished flag, metadata, a gauge) and ``resumes`` says whether a point starts a closed run again.

Point names and labels come from the training contract (``core.contract``); a run's state is ``runs.Run``.
Callers hold the ledger's lock: nothing here locks, reads a clock or touches files; the time a point was
received is passed in. Never touches the run's accumulator (``runs`` moves it over the snapshot history).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.ledger.runs import (
    COUNTERS,
    EPOCH,
    GLOBAL_STEP,
    HISTOGRAM,
    LEARNING_RATE,
    LOSS,
    RUN_FINISHED,
    RUN_GPU_INFO,
    RUN_INFO,
    RUN_TOTAL_STEPS,
    STEPS,
    VALIDATION_LOSS,
    LabelKey,
    Run,
    rank_order,
)
from gpu_energy_exporter.ledger.series_state import SeriesState
from gpu_energy_exporter.ledger.snapshot_frames import uuid_key

_RANK = contract.ATTR_RANK
_GPU_UUID = contract.ATTR_GPU_UUID
_GAUGES = frozenset((LOSS, VALIDATION_LOSS, LEARNING_RATE, EPOCH))
_POINT_LABELS = frozenset(contract.POINT_ATTRIBUTES)
_NOT_GPUS = frozenset({"", contract.GPU_NONE, contract.GPU_UNKNOWN})


class PointLike(Protocol):
    """What the OTLP store hands its listeners (``otlp.store.AcceptedPoint``)."""

    run_id: str
    name: str
    labels: Mapping[str, str]
    value: float
    time: float
    count: float | None
    key: tuple[tuple[str, str], ...] | None
    resource: tuple[tuple[str, str], ...]
    client: str



def apply_point(run: Run, name: str, labels: Mapping[str, str], value: float, t: float, count: float | None,
                received: float, key: LabelKey | None = None, rank: str | None = None) -> None:
    """One accepted point of the run (``received``: wall time it arrived; ``key``: ``labels`` as their sorted
    items, ``tuple(sorted(labels.items()))``, and ``rank`` its rank label, when the caller already has them)."""
    if rank is None:
        rank = labels.get(_RANK, "")
    run.changes += 1
    run.ranks.add(rank)
    run.last_point_received = received
    if t > run.last_point_t:
        run.last_point_t = t
    gpu_label = labels.get(_GPU_UUID, "")
    if gpu_label not in run.gpu_labels_seen:
        run.gpu_labels_seen.add(gpu_label)
        for part in gpu_label.split(","):
            _note_gpu(run, part)
    if name in COUNTERS or name == HISTOGRAM:
        _apply_counter(run, name, labels, rank, value, t, count, key)
        if name == STEPS and run.best_loss is not None and t <= run.best_loss_t:
            run.best_loss_step = run.counter(name)
    elif name == RUN_FINISHED:
        _apply_finished(run, rank, value, t)
    elif name == RUN_INFO:
        order = rank_order(rank)
        if run.meta_rank is None or order <= run.meta_rank:
            run.meta_rank = order
            run.metadata = {k: v for k, v in labels.items() if k not in _POINT_LABELS}
    elif name == RUN_GPU_INFO:
        pass  # its gpu_uuid label was noted above
    elif name == RUN_TOTAL_STEPS:
        run.total_steps = value if run.total_steps is None else max(run.total_steps, value)
    elif name == GLOBAL_STEP:
        seen = run.global_steps.get(rank)
        if seen is None or t >= seen[0]:
            run.global_steps[rank] = (t, value)
    elif name in _GAUGES:
        order = rank_order(rank)
        prev = run.gauges.get(name)
        # One rank's view (the lowest that sends it): ranks' local losses are not comparable values.
        if prev is not None and (order > prev[0] or (order == prev[0] and t < prev[1])):
            return
        run.gauges[name] = (order, t, value)
        if name == LOSS and (run.best_loss is None or value < run.best_loss):
            run.best_loss, run.best_loss_t = value, t
            run.best_loss_step = run.counter(STEPS)


def resumes(closed: Run, name: str, value: float, t: float) -> bool:
    """Whether a point of a closed run's id starts the run again."""
    # The SDK keeps re-exporting its last values until the trainer exits: only an explicit "running again"
    # (finished back to 0, after the end) resumes a closed run id.
    return name == RUN_FINISHED and value == 0 and closed.e is not None and t > closed.e


def gpu_keys(label: str) -> tuple[str, ...]:
    """The uuid keys a ``gpu_uuid`` label names (comma-joined; ``none``/``unknown`` name no GPU)."""
    return tuple(uuid_key(g) for g in label.split(",") if g.strip().lower() not in _NOT_GPUS)


def _note_gpu(run: Run, uuid: str) -> None:
    text = uuid.strip()
    if text.lower() in _NOT_GPUS:
        run.non_gpu_labels.add(text or "(empty)")
        return
    key = uuid_key(text)
    if key not in run.gpus:
        run.gpus[key] = text


def _apply_counter(run: Run, name: str, labels: Mapping[str, str], rank: str, value: float, t: float,
                   count: float | None, sorted_labels: LabelKey | None) -> None:
    key = (name, sorted_labels if sorted_labels is not None else tuple(sorted(labels.items())))
    s = run.series.get(key)
    if s is None:
        if run.fresh:
            # A fresh run's counters started at zero at its start: interpolate from there.
            s = SeriesState(name, rank, baseline=0.0, last_t=min(run.s, t), last_v=0.0)
        else:
            s = SeriesState(name, rank, baseline=value, last_t=t, last_v=value)
        s.gpus = gpu_keys(labels.get(contract.ATTR_GPU_UUID, ""))
        s.hist.append((s.last_t, s.last_v))
        run.series[key] = s
    if t < s.last_t:
        return
    if s.at_w is None and t >= run.w:
        if s.last_t >= run.w or t == s.last_t:
            s.at_w = s.last_v
        else:
            s.at_w = s.last_v + (value - s.last_v) * (run.w - s.last_t) / (t - s.last_t)
    s.last_t, s.last_v = t, value
    s.hist.append((t, value))
    if count is not None:
        s.count = count


def _apply_finished(run: Run, rank: str, value: float, t: float) -> None:
    if value >= 1:
        run.finished_at.setdefault(rank, t)
    else:
        run.finished_at.pop(rank, None)
        if run.status == "finishing":
            run.status, run.e = "running", None
        return
    if run.ranks and run.ranks <= set(run.finished_at) and not run.allocated:  # a job ends at its epilog
        run.e = max(run.s, max(run.finished_at.values()))
        run.status = "finishing"
