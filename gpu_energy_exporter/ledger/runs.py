"""A training run as the ledger tracks it: its state, and its accumulator kept in step with the snapshot history
(advanced, rewound, replayed, closed).

``advance``, ``rewind``, ``replay`` and ``close_accounts`` move a run's accumulator over frames of the snapshot
history, given who holds which GPU (``Holders``); what one accepted point does to the run is ``points``. The
training metrics' names come from the training contract (``core.contract``). Callers hold the ledger's lock:
nothing here locks, starts threads, reads a clock or touches files.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.ledger.accounting import Acc, Timeline, integrate
from gpu_energy_exporter.ledger.process_claims import ProcessKey, own_pids
from gpu_energy_exporter.ledger.series_state import SeriesState
from gpu_energy_exporter.ledger.snapshot_frames import Frame, GPUFrame
from gpu_energy_exporter.ledger.split import Holding

#: Training progress: the counters whose first point makes a tentative run id a run (with ``HISTOGRAM``).
COUNTERS = frozenset(i.prometheus for i in (contract.TOKENS, contract.SAMPLES, contract.STEPS, contract.FLOPS))
HISTOGRAM = contract.STEP_DURATION.prometheus
TOKENS = contract.TOKENS.prometheus
SAMPLES = contract.SAMPLES.prometheus
STEPS = contract.STEPS.prometheus
FLOPS = contract.FLOPS.prometheus
LOSS = contract.LOSS.prometheus
VALIDATION_LOSS = contract.VALIDATION_LOSS.prometheus
LEARNING_RATE = contract.LEARNING_RATE.prometheus
EPOCH = contract.EPOCH.prometheus
RUN_FINISHED = contract.RUN_FINISHED.prometheus
RUN_INFO = contract.RUN_INFO.prometheus
RUN_GPU_INFO = contract.RUN_GPU_INFO.prometheus
RUN_TOTAL_STEPS = contract.RUN_TOTAL_STEPS.prometheus
GLOBAL_STEP = contract.GLOBAL_STEP.prometheus

#: A run that started this long or longer before the first snapshot it is counted from says so (a note).
UNSEEN_START_S = 0.1

#: A point's labels as their sorted items: a counter series' identity within its run (with its name).
LabelKey = tuple[tuple[str, str], ...]

#: Physical GPU key -> the runs using it, at a frame's time (``RunLedger._holders``).
Holders = Callable[[Frame], Mapping[str, Sequence[Holding]]]


def rank_order(rank: str) -> tuple[int, str]:
    try:
        return (int(rank), "")
    except ValueError:
        return (1 << 30, rank)


class Run:
    """A training run (or a Slurm job) as the ledger tracks it. Its state is plain attributes, saved and restored
    by name (``ledger.codec``); set up below by what they are about."""

    def __init__(self, run_id: str, start: float, warmup: float, fresh: bool, timeline_points: int,
                 received: float) -> None:
        self.run_id = run_id
        self.s = start
        self.w = start + warmup
        self.e: float | None = None
        self.status = "running"
        self.fresh = fresh
        # Created by a point that is no training progress (run_info, run_finished, ...): not shown, never
        # written, never charged energy, evicted first; becomes a run at its first counter point.
        self.tentative = True
        self.closed_at: float | None = None
        self.notes: list[str] = []
        if not fresh:
            self.notes.append("resumed after it had finished or gone stale: counters counted from the "
                              "first point of this resumption")
        self._init_points(start, received)
        self._init_accounts(start, timeline_points)
        self._init_processes()
        self._init_outputs()

    def _init_points(self, start: float, received: float) -> None:
        """What the run's points said: its series, metadata, ranks, GPUs, gauges and progress."""
        self.series: dict[tuple[str, tuple[tuple[str, str], ...]], SeriesState] = {}
        self.metadata: dict[str, str] = {}
        self.meta_rank: tuple[int, str] | None = None
        self.ranks: set[str] = set()
        self.finished_at: dict[str, float] = {}  # rank -> time of its first finished=1 point
        self.gpus: dict[str, str] = {}  # uuid key -> uuid as pushed
        self.non_gpu_labels: set[str] = set()
        self.gpu_labels_seen: set[str] = set()  # gpu_uuid label values already noted (bounded by the series)
        self.gauges: dict[str, tuple[tuple[int, str], float, float]] = {}  # name -> (rank order, t, value)
        self.best_loss: float | None = None
        self.best_loss_t = 0.0
        self.best_loss_step: float | None = None
        self.total_steps: float | None = None
        self.global_steps: dict[str, tuple[float, float]] = {}  # rank -> (t, training_global_step)
        self.last_point_t = start
        self.last_point_received = received
        self.changes = 0  # bumped by every point applied to the run (a part of its live summary's stamp)
        self.overflowed: set[str] = set()  # counters whose total is not finite (shown as unknown)

    def _init_accounts(self, start: float, timeline_points: int) -> None:
        """Its accumulator with its checkpoints, its timeline, and what its GPUs' intervals said."""
        self.start_accounts(start)
        self.timeline = Timeline(timeline_points)
        self.gpu_order: list[str] = []  # frame keys in timeline order
        self.gpu_info: dict[str, GPUFrame] = {}  # last frame of each GPU (names, idle power)
        self.resolved: set[str] = set()  # run GPU keys counted in some snapshot interval
        self.splits: set[str] = set()  # split rules used for the run's GPUs (ledger_split)
        self.sharers: set[str] = set()  # other runs it shared a GPU with
        self.unconfirmed: dict[str, str] = {}  # GPU key -> why its claim went uncharged after the grace
        self.silent: set[int] = set()  # pids of processes that are no run's that shared its GPUs (some)

    def _init_processes(self) -> None:
        """Who the run is: the processes and clients that push for it, its Slurm allocation, its restore."""
        # The processes that pushed for the run (``ProcessKey``) -> (rank, first seen, last seen), and the job
        # identity they share (``contract.JOB_IDENTITY_LABELS``): what ties the run to NVML's processes.
        self.procs: dict[ProcessKey, list[Any]] = {}
        self.job: dict[str, str] = {}
        self.admitted: tuple[object, float, str] = ((), -1.0, "")  # (resource, received, rank) last admitted
        self.client = ""  # the client (core.clientid) whose first progress point made it a run
        self.owners: dict[str, str] = {}  # rank -> the client its points are taken from (ledger.clients)
        self.allocated: set[str] = set()  # GPU keys a Slurm job's allocation gives the run (ledger.jobs)
        # Restored from the journal after a restart: series key -> whether its first point since was seen
        # (``ledger.restart.reconcile``); None for a run this process started.
        self.restored: dict[tuple[str, LabelKey], bool] | None = None
        self.serving: Any = None  # a serving session's own state (ledger.serving.ServingState); None: training

    def _init_outputs(self) -> None:
        """What was made of it: its summary, the counters /metrics served, its files' writes, kept summaries."""
        self.summary: dict[str, Any] | None = None
        self.exposed: dict[str, float] = {}  # counter name -> highest value collect() has served
        self.written_json: str | None = None  # summary file already written (a retried write keeps it)
        self.write_failures = 0
        self.next_write_try = 0.0
        self.live_memo: tuple[tuple[int, ...], dict[str, Any]] | None = None  # (stamp, live summary)
        self.settled_memo: tuple[tuple[int, ...], dict[str, Any]] | None = None  # (stamp, settled summary)

    def start_accounts(self, start: float) -> None:
        """The run's accounts begin at ``start``, its first checkpoint: a recount can always go back there.

        The first counter read after a run's edge settles a span that begins at that edge's read of the GPU,
        a little before the frame it is in (the run's first checkpoint from the snapshots) when another GPU
        was read after it. Without a checkpoint at the start, that recount found none early enough and was
        skipped: the run kept the power readings' estimate of its first seconds, which no counter had scaled
        when the exporter had just started (6% high on a 20 ms wave: +1.0% of a 15 s run)."""
        self.s = start
        self.acc = Acc(t=start)
        self.checkpoints: deque[Acc] = deque([self.acc.copy()])  # the accumulator at snapshots (the first: its start)
        self.alive_checkpoint = self.acc.copy()  # the last checkpoint not after the last point

    # -- counters ------------------------------------------------------------------------------------

    def counter(self, name: str, local: Callable[[SeriesState], bool] | None = None) -> float | None:
        """Summed over series (max for steps); ``local`` keeps only the series it accepts."""
        values = [s.last_v - s.baseline for s in self.series.values()
                  if s.name == name and (local is None or local(s))]
        if not values:
            return None
        return self._finite(name, max(values) if name == STEPS else sum(values))

    def _finite(self, name: str, total: float) -> float | None:
        """``total``, or None when it is not finite (two ranks' 1.5e308 tokens), noted in ``overflowed``."""
        if math.isfinite(total):
            return total
        self.overflowed.add(name)
        return None

    def counter_at(self, name: str, t: float, local: Callable[[SeriesState], bool] | None = None) -> float | None:
        """``counter`` as it stood at ``t`` (each series interpolated between its points)."""
        values = [s.value_at(t) for s in self.series.values() if s.name == name and (local is None or local(s))]
        if not values:
            return None
        return self._finite(name, max(values) if name == STEPS else sum(values))

    def counter_at_w(self, name: str, local: Callable[[SeriesState], bool] | None = None) -> float | None:
        values = [(s.at_w if s.at_w is not None else s.last_v) - s.baseline
                  for s in self.series.values() if s.name == name and (local is None or local(s))]
        if not values:
            return None
        return self._finite(name, max(values) if name == STEPS else sum(values))

    def gauge(self, name: str) -> float | None:
        entry = self.gauges.get(name)
        return entry[2] if entry is not None else None

    def global_step(self) -> float | None:
        """The trainer's global step (steps before a resume included): the highest rank's latest value."""
        return max(v for _, v in self.global_steps.values()) if self.global_steps else None

    # -- accounting ----------------------------------------------------------------------------------

    def checkpoint_before(self, t: float) -> Acc | None:
        """The latest checkpoint not after ``t`` (None when every one is later)."""
        candidates = [c for c in (*self.checkpoints, self.alive_checkpoint) if c.t <= t]
        return max(candidates, key=lambda c: c.t) if candidates else None

    def parents(self, frame: Frame | None) -> set[str]:
        """The frame's physical GPUs the run names (MIG instances -> their parent)."""
        if frame is None:
            return set()
        return {frame.mig_parent.get(k, k) for k in self.gpus}

    def frame_keys(self, frame: Frame) -> list[str]:
        """The frame's keys of the run's GPUs (MIG instances -> their parent, once each); GPUs the frame
        does not have keep their own key (they count as expected GPU-time without energy)."""
        keys: list[str] = []
        for key in self.gpus:
            k = frame.mig_parent.get(key, key)
            if k not in keys:
                keys.append(k)
        return keys

    def count_interval(self, acc: Acc, f0: Frame, f1: Frame, lo: float, hi: float, holders: Holders, *,
                       live: bool) -> None:
        """Add the part of the snapshot interval (f0, f1] that lies in [lo, hi] to ``acc``; ``live``: the
        run's own accumulator moving forward, which also extends its timeline."""
        if live and acc.t <= self.s and f0.t > self.s + UNSEEN_START_S and self.restored is None:
            # Its first interval begins after its start: it started before the exporter's first snapshot
            # (a push retried while the exporter was starting), and nothing before that snapshot was read.
            note = f"started {f0.t - self.s:.1f}s before the exporter's first snapshot: that part is not charged"
            if note not in self.notes:
                self.notes.append(note)
        seg = integrate(acc, f0, f1, lo, hi, run_id=self.run_id, window_start=self.w,
                        keys=self.frame_keys(f1), holders=holders(f1))
        if seg is None:
            return
        for key, g1 in seg.gpus:
            self.gpu_info[key] = g1
            if key not in self.gpu_order:
                self.gpu_order.append(key)
        if seg.gpus:  # found in a snapshot and counted (a GPU only looked up stays listed as not found)
            counted = {key for key, _ in seg.gpus}
            self.resolved.update(k for k in self.gpus if f1.mig_parent.get(k, k) in counted)
        self.splits |= seg.splits
        self.sharers |= seg.sharers
        for key, reason in seg.unconfirmed.items():
            self.unconfirmed.setdefault(key, reason)
        if len(self.silent) < 64:
            self.silent |= seg.silent
        if live and seg.inside:
            power = tuple(f1.gpus[k].power_w if k in f1.gpus else None for k in self.gpu_order)
            self.timeline.add((
                f1.t, power, acc.energy_j, self.counter(TOKENS), self.counter(STEPS), self.gauge(LOSS),
                seg.vram_sum, f1.host_available,
            ))


# ----------------------------------------------------------------------------------------------------
# the accumulator over the snapshot history


def holdings(frame: Frame, tracked: Iterable[Run], grace_s: float = math.inf) -> dict[str, list[Holding]]:
    """Physical GPU key -> the runs using it (with the MIG instance they name, and the pids NVML lists there
    that are theirs), as known now, in the order the runs started. Runs still tentative hold nothing; closed
    runs hold their GPUs from start to end, and nothing after. A listed pid belongs to the run active in it at
    each moment (``split.piece_shares``): two runs one after the other in one process are each charged
    their own interval; while two runs that declare the same pid are both active, the one that started first
    keeps it (a later run cannot take a running one's process by naming its pid)."""
    out: dict[str, list[Holding]] = {}
    order = sorted((r for r in tracked if not r.tentative), key=lambda r: r.s)
    for run in order:
        end = run.e if run.e is not None else math.inf
        for key in run.gpus:
            parent = frame.mig_parent.get(key, key)
            g = frame.gpus.get(parent)
            if g is None:
                continue
            held = out.setdefault(parent, [])
            pids = own_pids(run, g.procs) if g.procs is not None and run.procs else frozenset()
            slices = frame.mig_profile.get(key, (1, None))[0] if parent != key else 1
            held.append(Holding(run.run_id, run.s, end, key if parent != key else "", slices, pids,
                                run.s + grace_s, bool(run.procs), key in run.allocated))
    return out


def advance(run: Run, f0: Frame, f1: Frame, holders: Holders, late_window_s: float) -> None:
    """Count the newest snapshot interval (f0, f1] for the run and checkpoint its accumulator."""
    hi = run.e if run.e is not None else math.inf
    if run.acc.t >= hi:
        return
    run.count_interval(run.acc, f0, f1, max(run.acc.t, run.s), hi, holders, live=True)
    run.acc.t = max(run.acc.t, min(f1.t, hi))
    if run.e is not None:
        return
    # Points arrive after the snapshot that precedes them: the checkpoint of that snapshot is the last one
    # not after the run's last point (a run that stops pushing replays from there, not from its start).
    if run.checkpoints and run.alive_checkpoint.t < run.checkpoints[-1].t <= run.last_point_t:
        run.alive_checkpoint = run.checkpoints[-1]
    ckpt = run.acc.copy()
    run.checkpoints.append(ckpt)
    while run.checkpoints and run.checkpoints[0].t < f1.t - late_window_s:
        run.checkpoints.popleft()
    if run.last_point_t >= f1.t:
        run.alive_checkpoint = ckpt


def rewind(run: Run, t: float, history: Sequence[Frame], holders: Holders) -> None:
    """Recount the run from its last checkpoint before ``t`` up to where it was (who held its GPUs changed
    at ``t``)."""
    target = run.acc.t
    # A change before the run's start counts from its start: its first checkpoint (``start_accounts``).
    t = max(t, run.s)
    base = run.checkpoint_before(t)
    first = history[0].t if history else math.inf
    if (base is None and t < first) or (base is not None and run.s < base.t < first):
        # Nothing before the history's first snapshot can be counted again: a restored run's checkpoint predates
        # the restart, whose saved snapshot left the history once the gap closed (a recount from it lost the
        # gap's energy). Recount from the first checkpoint the history covers; what is before stays counted.
        covered = [c for c in (*run.checkpoints, run.alive_checkpoint) if first <= c.t <= target]
        base = min(covered, key=lambda c: c.t) if covered else None
    if base is None:
        note = ("another run started or ended on its GPUs earlier than the ledger can recount: the split "
                "of that moment is approximate")
        if note not in run.notes:
            run.notes.append(note)
        return
    acc = base.copy()
    run.checkpoints = deque(c for c in run.checkpoints if c.t <= base.t)
    hi = run.e if run.e is not None else math.inf
    frames = list(history)
    for f0, f1 in zip(frames, frames[1:], strict=False):
        if f1.t <= acc.t or f0.t >= min(hi, target):
            continue
        run.count_interval(acc, f0, f1, max(acc.t, run.s), min(hi, target), holders, live=False)
        acc.t = max(acc.t, min(f1.t, hi, target))
        if run.e is None:
            ckpt = acc.copy()
            run.checkpoints.append(ckpt)
            if run.last_point_t >= f1.t:
                run.alive_checkpoint = ckpt
    if run.alive_checkpoint.t > acc.t:
        run.alive_checkpoint = acc.copy()
    run.acc = acc


def replay(run: Run, acc: Acc, history: Sequence[Frame], lo: float, hi: float, holders: Holders, *,
           live: bool) -> None:
    """Count the history's intervals between ``lo`` and ``hi`` into ``acc``."""
    # Intervals ending at or before lo add nothing: start at the last snapshot not after lo (a live
    # summary replays from a recent checkpoint, so this reads the history's tail, not all of it).
    frames: list[Frame] = []
    for frame in reversed(history):
        frames.append(frame)
        if frame.t <= lo:
            break
    frames.reverse()
    for f0, f1 in zip(frames, frames[1:], strict=False):
        if f0.t >= hi:
            break
        if f1.t <= lo:
            continue
        run.count_interval(acc, f0, f1, lo, hi, holders, live=live)
        acc.t = max(acc.t, min(f1.t, hi))


def close_accounts(run: Run, status: str, history: Sequence[Frame], holders: Holders) -> None:
    """Cut the run's accumulator and timeline at its end and give it ``status``."""
    e = max(run.e if run.e is not None else run.acc.t, run.s)
    if run.acc.t > e or status == "stale":
        # The end lies before snapshots already counted: restart from the last checkpoint before it
        # and replay the snapshot history up to the end.
        base = run.checkpoint_before(e)
        if base is None:
            base = Acc(t=run.s)
        if history and history[0].t > base.t:
            run.notes.append("the run's end fell outside the snapshot history: energy near the end may "
                             "be missing")
        acc = base.copy()
        replay(run, acc, history, max(acc.t, run.s), e, holders, live=False)
        run.acc = acc
    elif run.acc.t < e and status != "exporter_stopped":
        run.notes.append("no snapshot after the run's end (exporter stopping): energy counted to the "
                         "last snapshot")
    run.acc.t = e
    run.e = e
    run.status = status
    run.timeline.trim_after(e)
    run.timeline.add((
        e, tuple(run.gpu_info[k].power_w if k in run.gpu_info else None for k in run.gpu_order),
        run.acc.energy_j, run.counter(TOKENS), run.counter(STEPS), run.gauge(LOSS), None, None,
    ), force=True)
    run.checkpoints.clear()



def recount(active: Mapping[str, Run], fresh: Iterable[str], since: Mapping[str, float],
            history: Sequence[Frame], holders: Holders) -> int:
    """Count the ``fresh`` runs' snapshots from their start, then recount each run of ``since`` (run id ->
    time who held its GPUs changed) from its last checkpoint before that time; returns the snapshot
    intervals visited (the work done)."""
    visited = 0

    def counted(frame: Frame) -> Mapping[str, Sequence[Holding]]:
        nonlocal visited
        visited += 1
        return holders(frame)

    for run_id in fresh:
        run = active.get(run_id)
        if run is not None and not run.tentative:
            replay(run, run.acc, history, run.s, math.inf, counted, live=True)
    for run_id, t in since.items():
        run = active.get(run_id)
        if run is not None and not run.tentative and run.acc.t > t:
            rewind(run, t, history, counted)
    return visited
