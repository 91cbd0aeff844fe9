"""The run ledger: per training run energy, tokens, J/token, power, VRAM and CO2, without Prometheus.

Fed from two sides: ``on_point`` receives every point the OTLP store accepted (request threads) and
``on_snapshot`` every sampler snapshot (sampler thread). A run lives from its first point until every
rank that pushed has sent ``training_run_finished 1`` (or until nothing was pushed for ``stale_after``,
in which case it ends at its last point). Then its row goes into the database (``ledger.store``), then to the
CSV and a JSON summary (``<csv dir>/runs/<run id>.json``) by the file writer's thread. With a database
(``state_dir``, ``db_path``) open runs outlive the process (``restart``); all times are on ``clock`` (in the
daemon the steady clock, with ``wall`` the clock snapshots are stamped with).
``collect()`` serves per-run series on /metrics; ``runs()`` / ``run(run_id)`` feed the JSON API
(``daemon/api.py``: ``/api/v1/runs``, ``/api/v1/run?id=``) that ``top``, ``report`` and ``runs --url`` read.
How the figures are made: the package's docstring (``gpu_energy_exporter.ledger``) and docs/ledger.md.

This module never calls NVML or reads hardware, never integrates power into energy, and never raises
into the sampler or request threads, and never touches a file on them: a failing write is logged and
counted, the row is kept (in the database) and retried with back-off by the file writer's thread.

This module is the ledger's driver: the lock, the snapshot history, who holds which GPU, when runs open
and close, and the write-retry queue; what /metrics and the JSON API get is read in ``views`` (inherited).
Beside it: a run's state and the accumulator's moves in ``runs``, what a point does to a run in ``points``,
interval accounting in ``accounting``, settlement at counter reads in ``settlement``, figures in ``summary``,
snapshot framing in ``frames``, files in ``files``, series in ``specs``, who may change a run and per-identity
bounds in ``clients``, the store's gate that asks them before a point is stored, and a new run's slot, in
``admission`` (inherited).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.core.ratelog import RateLimitedLog
from gpu_energy_exporter.core.runs_schema import KEEP_FINISHED_S
from gpu_energy_exporter.core.state import Snapshot
from gpu_energy_exporter.ledger import accounting, carry, clients, files, jobs, points, restart, runs, settlement, specs
from gpu_energy_exporter.ledger.admission import LedgerAdmission
from gpu_energy_exporter.ledger.files import iso_utc
from gpu_energy_exporter.ledger.filewriter import Row
from gpu_energy_exporter.ledger.points import PointLike
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.served_views import LedgerViews
from gpu_energy_exporter.ledger.serving import track as track_serving
from gpu_energy_exporter.ledger.snapshot_frames import Frame, frame_of
from gpu_energy_exporter.ledger.split import Holding
from gpu_energy_exporter.ledger.summary import fmt, with_provisional

log = logging.getLogger(__name__)

# Read for every point pushed (_record_locked): module constants, not attribute lookups each time.
_isfinite = math.isfinite
_RANK = contract.ATTR_RANK
_PROGRESS = runs.COUNTERS | {runs.HISTOGRAM}  # training progress: a tentative run id becomes a run
_FINISHED = runs.RUN_FINISHED

#: () -> (grid intensity g/kWh, PUE[, (when the intensity took that value, wall clock; the value before) or None])
CarbonSource = Callable[[], "tuple[float, float] | tuple[float, float, tuple[float, float] | None]"]


class RunLedger(LedgerAdmission, LedgerViews):
    """Per-run energy accounting. Thread-safe: one lock; file writes happen outside it.

    ``csv_path``: ``--runs.csv`` (None keeps runs in memory only). ``warmup_s``: ``--runs.warmup``.
    ``stale_after_s``: ``--runs.stale-after``. ``carbon``: returns (grid intensity g/kWh, PUE), called
    once per snapshot on the sampler thread; None means no CO2 figures. ``clock``: the ledger's time
    (intervals, staleness, how long finished runs are kept); ``wall``: the clock snapshots are stamped
    with when ``clock`` is another one (the daemon's steady clock): snapshots are then dated by ``clock``
    and senders' timestamps placed against their arrival. ``state_dir``/``db_path``: ``--runs.state-dir``/``--runs.db``
    (neither: runs in memory only); ``background_writes``: files written by their own thread (the daemon)
    rather than on the thread that closes a run; ``journal_interval_s``: ``--runs.journal-interval``.
    """

    def __init__(
        self,
        csv_path: str | None,
        warmup_s: float = 30.0,
        stale_after_s: float = 300.0,
        carbon: CarbonSource | None = None,
        clock: Callable[[], float] = time.time,
        *,
        timeline_points: int = 2000,
        keep_finished_s: float = KEEP_FINISHED_S,
        max_finished_runs: int = 100,
        max_active_runs: int = 256,
        late_window_s: float = 120.0,
        state_dir: str | None = None,
        wall: Callable[[], float] | None = None,
        background_writes: bool = False,
        journal_interval_s: float = 5.0,
        claim_grace_s: float = 30.0,
        max_active_per_client: int = 64,
        new_runs_per_client_per_minute: float = 60.0,
        finished_runs_per_client_per_minute: float = 60.0,
        max_backdate_s: float = 10.0,
        settle_wait_s: float = 75.0,
        db_path: str | None = None,
    ) -> None:
        if warmup_s < 0 or stale_after_s <= 0:
            raise ValueError("warmup_s must be >= 0 and stale_after_s > 0")
        self.csv_path = csv_path
        self.warmup_s = warmup_s
        self.stale_after_s = stale_after_s
        self._carbon = carbon
        self._carbon_error_logged = False
        self._clock = clock
        self._wall = wall  # the wall clock snapshots are stamped with, when ``clock`` is another (steady) one
        self._timeline_points = timeline_points
        self._late_window_s = late_window_s
        self._max_backdate_s = max_backdate_s
        self.claim_grace_s = claim_grace_s  # --runs.claim-grace (ledger.split)
        self.settle_wait_s = settle_wait_s
        self._clients = clients.ClientBounds(max_active=max_active_per_client,
                                             new_per_minute=new_runs_per_client_per_minute,
                                             finished_per_minute=finished_runs_per_client_per_minute)
        self._init_runs(max_active_runs, max_finished_runs, keep_finished_s)
        # Snapshots are kept long enough to replay a stale run from its last point.
        self._init_history(stale_after_s + late_window_s)
        self._init_served()
        # The store (open runs outlive the exporter, every finished run's row) and the exports: ``restart``.
        self._durable = restart.Durable(self, state_dir, background_writes, journal_interval_s, db_path)

    def _init_runs(self, max_active: int, max_finished: int, keep_finished_s: float) -> None:
        """The runs, open and closed, and what the points that made them left to check."""
        self._lock = threading.RLock()
        self._max_active = max_active
        self._active: dict[str, Run] = {}
        # Closed runs are kept for keep_finished_s, at most max_finished of them: bounds memory under heavy run
        # churn (each keeps its timeline for report/top); the CSV and JSON files keep every run.
        self._closed: list[Run] = []
        self._max_finished = max_finished
        self._keep_finished_s = keep_finished_s
        self._finished_counts: dict[str, float] = dict.fromkeys(specs.STATUSES, 0.0)
        self._rejected = 0.0
        self._evicted = 0.0
        self._claims = specs.ClaimTally()  # refused processes, closed runs' unconfirmed GPU claims
        self._job_ids: set[str] = set()  # active runs that are Slurm jobs (ledger.jobs)
        self._offsets: dict[str, dict[str, float]] = {}  # run id -> rank -> sender clock offset (restart)
        # (run, rank, client, resource, received) of the last point that passed the client and process checks
        # in this chunk of points (_record_locked), None when the next point must be checked
        self._admitted: tuple[object, ...] | None = None
        # (run id, identity) -> the run id a colliding identity's points go to (``_admit_locked``)
        self._scoped: dict[tuple[str, str], str] = {}
        self._new_process: set[str] = set()  # runs a process joined at the gate, not recorded yet
        # Per-run lines (started, finished, stale, refused) under a flood of runs: 30 of each a minute, then
        # a count (core.ratelog); the counters on /metrics stay exact.
        self._runs_log = RateLimitedLog(log, burst=30)

    def _init_history(self, history_s: float) -> None:
        """The snapshot history, who holds which GPU in it, and what its counter reads settled or owe."""
        self._history: deque[Frame] = deque()
        self._history_s = history_s
        # Who uses which GPU, by snapshot time (ledger_split.Holding), rebuilt when runs change.
        self._holders_gen = 0
        self._holders_cache: dict[float, dict[str, list[Holding]]] = {}
        self._holders_cache_gen = -1
        # Energy of each GPU charged to no run, settled when its interval leaves the snapshot history
        # (no late point can change who used the GPU then): uuid key -> (gpu index, uuid, joules).
        self._unattributed: dict[str, tuple[str, str, float]] = {}
        self._anchors: dict[str, float] = {}  # GPU key -> its last counter read (frame clock; settlement)
        # Recounts owed since the last snapshot or read: new runs' first replay, run id -> recount from.
        self._replay_pending: set[str] = set()
        self._recount_from: dict[str, float] = {}
        self.recount_intervals = 0  # snapshot intervals recounted (bench/ledger_backdated.py)

    def _init_served(self) -> None:
        """What tells readers the figures changed, and the closed runs' rows not written yet."""
        self._version = 0  # bumped whenever what collect() returns may have changed
        # Parts of each live summary's stamp (with the run's own points and _holders_gen): bumped by every
        # snapshot counted and every expiry of finished runs.
        self._snapshots = 0
        self._expirations = 0
        # Closed runs not written yet (kept in the database until they are): seq -> row. The file writer retries
        # failed ones with back-off.
        self._pending: dict[int, Row] = {}
        self._seq = 0
        self._write_errors = 0.0

    # ------------------------------------------------------------------------------------------------
    # points (request threads)

    def on_point(self, point: PointLike) -> None:
        """Store listener: ``TrainingStore.add_listener(ledger.on_point)``."""
        self.on_points((point,))

    #: points recorded per lock acquisition in ``on_points`` (a scrape of the ledger waits for one chunk)
    POINTS_CHUNK = 256

    def on_points(self, points: Sequence[PointLike]) -> None:
        """Store batch listener (``TrainingStore.add_batch_listener``): ``on_point`` for each of one
        request's points, taking the lock once per ``POINTS_CHUNK`` points. Points the store's gate
        (``admit``) let in (``admitted``) are not checked again."""
        record = self._record_locked
        for start in range(0, len(points), self.POINTS_CHUNK):
            with self._lock:
                received = self._clock()  # one request's points arrived together
                self._admitted = None
                for point in points[start:start + self.POINTS_CHUNK]:
                    count = point.count
                    record(point.run_id, point.name, point.labels, point.value, point.time,
                           float(count) if count is not None else None, point.key, received, point.resource,
                           point.client, getattr(point, "admitted", False))

    def record(self, run_id: str, name: str, labels: Mapping[str, str], value: float, t: float, *,
               count: float | None = None, client: str = "") -> None:
        """One accepted point: ``value`` cumulative for counters (the histogram's sum, with ``count``),
        the value for gauges; ``t`` in Unix seconds; ``client``: who pushed it (``core.clientid``)."""
        with self._lock:
            self._admitted = None
            self._record_locked(run_id, name, labels, value, t, count, client=client)

    def _record_locked(self, run_id: str, name: str, labels: Mapping[str, str], value: float, t: float,
                       count: float | None, key: runs.LabelKey | None = None, received: float | None = None,
                       resource: tuple[tuple[str, str], ...] = (), client: str = "", admitted: bool = False) -> None:
        """``key``, ``received``: ``labels`` as their sorted items, the clock's time, when the caller has them;
        ``admitted``: the store's gate (``admit``) let the point in already."""
        if not run_id or not _isfinite(value) or not _isfinite(t):
            return
        if received is None:
            received = self._clock()
        rank = labels.get(_RANK, "")
        if not admitted:  # checked here, as the gate would have (a point not through the store, or no gate)
            verdict = self._admit_locked(run_id, name, rank, value, t, resource, client, received)
            if isinstance(verdict, tuple):
                return
            run_id = verdict or run_id
        if self._job_ids and resource:
            run_id = jobs.alias(self._active, run_id, resource)  # a job's rank under a run id of its own
        progress = name in _PROGRESS
        self._version += 1
        if self._wall is not None:  # on the steady clock: senders' clocks are placed against it
            t = restart.steady_point_time(self._offsets, run_id, rank, t, received, self._late_window_s)
        run = self._active.get(run_id)
        if run is None:
            run = self._new_run(run_id, name, value, t, client, received)
            if run is None:
                self._offsets.pop(run_id, None)
                return
        gpus_before, end_before = len(run.gpus), run.e
        new_process = run.run_id in self._new_process
        if new_process:
            self._new_process.discard(run.run_id)
        if run.restored is not None and progress:
            restart.reconcile(run, name, labels, value, key)
        points.apply_point(run, name, labels, value, t, count, received, key, rank)
        if len(run.gpus) != gpus_before or new_process:
            self._holders_gen += 1  # a GPU named for the first time
        if run.tentative:
            if not progress:
                return
            # The run's first training progress: it becomes a run. Its first point was stamped by the
            # trainer when it was collected, possibly before snapshots already received: count those
            # now that the run's GPUs are known, and give runs sharing its GPUs their new share.
            run.tentative = False
            self._holders_changed(run, run.s)
            self._replay_pending.add(run_id)  # counted with the other recounts (_recount)
            self._runs_log.info("started", "run %s started (first point at %s)", run_id, iso_utc(run.s))
            self._durable.started()
            return
        if len(run.gpus) != gpus_before or new_process:
            self._holders_changed(run, run.s)
        elif run.e != end_before:
            self._holders_changed(run, min(x for x in (run.e, end_before) if x is not None))

    # ------------------------------------------------------------------------------------------------
    # snapshots (sampler thread)

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Sampler listener: ``Sampler.add_listener(ledger.on_snapshot)``."""
        frame = frame_of(snapshot, *self._carbon_now())
        if self._wall is not None:
            # Stamped by the wall clock: dated on the ledger's (steady) clock instead.
            frame = restart.on_clock(frame, self._clock())
        with self._lock:
            if self._history and frame.t <= self._history[-1].t:
                return  # a repeated or out-of-order snapshot adds nothing
            self._recount()
            self._version += 1
            self._snapshots += 1
            prev = self._history[-1] if self._history else None
            if prev is not None and self._durable.gap_pending:
                if not self._durable.gap_ready(prev, frame):
                    return  # the GPU counters are not readable yet: the gap closes at a later snapshot
                self._durable.note_gap(prev, frame)
            self._take(frame)
            prev = self._history[-2] if prev is not None else None  # as settled
            while len(self._history) > 1 and self._history[0].t < frame.t - self._history_s:
                self._settle(self._history[0], self._history[1])
                self._history.popleft()
            # Slurm jobs are runs: opened, given their GPUs and ended by the job-mapping directory (ledger.jobs).
            if jobs.track(snapshot.slurm_jobs, prev, frame, self._active, self._open_job, self._holders_changed,
                          wall=snapshot.timestamp - frame.age, max_backdate_s=self._max_backdate_s):
                self._durable.started()
            if track_serving(self, snapshot.serving, prev, frame, snapshot.timestamp - frame.age):
                self._durable.started()  # local inference servers' sessions are runs (ledger.serving)
            self._job_ids = {r.run_id for r in self._active.values() if r.allocated}
            now = self._clock()
            self._advance(prev, frame, now)
            self._expire(now)
        self._durable.after_snapshot(now)

    def _carbon_now(self) -> tuple[float | None, float | None, tuple[float, float] | None]:
        """(grid intensity, PUE, when the intensity took that value and the value before) from the carbon
        source; all None without one, or when it fails (logged once: a carbon source bug never stops the ledger)."""
        if self._carbon is None:
            return None, None, None
        try:
            carbon = self._carbon()
            return carbon[0], carbon[1], carbon[2] if len(carbon) > 2 else None
        except Exception as exc:  # noqa: BLE001 - a carbon source bug must not stop the ledger
            if not self._carbon_error_logged:
                log.warning("run ledger: carbon intensity unavailable (%s); CO2 figures will be missing", exc)
                self._carbon_error_logged = True
            return None, None, None

    def _take(self, frame: Frame) -> None:
        """Add ``frame`` to the history; settle the spans its counter reads closed."""
        self._history.append(frame)
        for key, gf in frame.gpus.items():
            if key not in self._unattributed:
                self._unattributed[key] = (str(gf.index), gf.uuid, 0.0)
            if gf.span is not None and gf.settled:
                self._settled_gpu(key, frame)

    def _advance(self, prev: Frame | None, frame: Frame, now: float) -> None:
        """Count the interval (prev, frame] for every run; drop ids that never became runs, close stale runs
        and ended runs whose energy is settled."""
        for run in list(self._active.values()):
            if run.tentative:
                if run.e is not None or now - run.last_point_received > self.stale_after_s:
                    del self._active[run.run_id]  # never a run: no row, no series
                    self._offsets.pop(run.run_id, None)
                continue
            if prev is not None:
                runs.advance(run, prev, frame, self._holders, self._late_window_s)
        for run in list(self._active.values()):
            if run.tentative:
                continue
            if run.e is None and now - run.last_point_received > self.stale_after_s:
                run.status = "stale"
                run.e = run.last_point_t
                self._runs_log.warning("stale", "run %s: nothing pushed for %.0fs; closing it as stale at its "
                                       "last point (%s)", run.run_id, self.stale_after_s, iso_utc(run.e))
                self._holders_changed(run, run.e)
            ended = run.e is not None and (frame.t >= run.e or run.status == "stale")
            if ended and settlement.closable(run, frame, self._anchors, self.settle_wait_s):
                self._close(run, run.status if run.status == "stale" else "finished")

    def _settled_gpu(self, key: str, frame: Frame) -> None:
        """``frame`` read GPU ``key``'s counter: settle the span it closed, recount the runs holding the GPU."""
        anchor = self._durable.carried.pop(key, None)  # its last read before a restart
        if anchor is not None and carry.across(self, key, frame, anchor):
            return
        start = settlement.settle_gpu(self._history, key)
        t = settlement.anchor_time(frame, key)
        if t is not None:
            self._anchors[key] = t
        if start is not None:
            self._holders_gen += 1  # the frames' process weights changed
            for run_id in settlement.holding_since(self._active.values(), key, start, frame):
                since = self._recount_from.get(run_id)
                self._recount_from[run_id] = start if since is None else min(since, start)

    def _settle(self, f0: Frame, f1: Frame) -> None:
        """Add the unattributed part of each GPU's energy over (f0, f1] to its total."""
        for key, g1, joules in accounting.unattributed(f0, f1, self._holders(f1)):
            index, uuid, total = self._unattributed.get(key, (str(g1.index), g1.uuid, 0.0))
            self._unattributed[key] = (index, uuid, total + joules)

    def _holders(self, frame: Frame) -> dict[str, list[Holding]]:
        """``runs.holdings`` of the runs known now, cached per frame until runs change."""
        if self._holders_cache_gen != self._holders_gen:
            self._holders_cache.clear()
            self._holders_cache_gen = self._holders_gen
        cached = self._holders_cache.get(frame.t)
        if cached is not None:
            return cached
        out = runs.holdings(frame, (*self._closed, *self._active.values()), self.claim_grace_s)
        if len(self._holders_cache) > 4 * len(self._history) + 16:
            self._holders_cache.clear()
        self._holders_cache[frame.t] = out
        return out

    def _holders_changed(self, run: Run, t: float) -> None:
        """``run`` started, ended or named a GPU at ``t``: runs sharing its GPUs that already counted
        snapshots after ``t`` are recounted from their last checkpoint before it, with the new split; once for
        all the changes before the next snapshot or read (``_recount``), not once per point: a request of 16
        backdated new runs costs one recount of each run sharing their GPUs, not 16."""
        self._holders_gen += 1
        latest = self._history[-1] if self._history else None
        mine = run.parents(latest)
        if not mine:
            return
        for other in self._active.values():
            if other is run or other.tentative or other.acc.t <= t or not (mine & other.parents(latest)):
                continue
            since = self._recount_from.get(other.run_id)
            self._recount_from[other.run_id] = t if since is None else min(since, t)

    def _recount(self) -> None:
        """Count new runs' snapshots before their first point arrived, then recount the runs whose GPUs'
        holders changed (``_holders_changed``), each once, with who holds which GPU known as of now."""
        if self._replay_pending or self._recount_from:
            fresh, self._replay_pending = self._replay_pending, set()
            since, self._recount_from = self._recount_from, {}
            self.recount_intervals += runs.recount(self._active, fresh, since, self._history, self._holders)

    # ------------------------------------------------------------------------------------------------
    # closing a run

    def _close(self, run: Run, status: str) -> None:
        self._recount()
        self._holders_gen += 1
        # Settled to its end (its end read the counters), unless a GPU's counter could not be read after it
        # (``_settled_to`` waited settle_wait_s): the part since that GPU's last read stays provisional.
        end = run.e if run.e is not None else run.acc.t
        t = self._settled_time(run, cap=end)
        settled = self._summary_as_of(run, t) if t < end - 1e-6 else None
        runs.close_accounts(run, status, self._history, self._holders)
        run.closed_at = self._clock()
        run.summary = with_provisional(self._summary(run), settled)
        del self._active[run.run_id]
        self._offsets.pop(run.run_id, None)
        self._closed.append(run)
        self._claims.closed(run.unconfirmed.values())
        self._finished_counts[status] = self._finished_counts.get(status, 0.0) + 1
        s = run.summary
        self._runs_log.info("finished", "run %s %s: %.0fs, %s tokens, %s J, %s J/token", run.run_id, status,
                            s["duration_s"], fmt(s["tokens"]), fmt(s["energy_j"]), fmt(s["j_per_token"]))
        if self._durable.keeps_rows:  # the database, the CSV or both
            self._seq += 1
            row = Row(self._seq, run.run_id, run.s, dict(s), self._document(run, dict(s)))
            row.extra["run"] = run
            self._pending[row.seq] = row
            self._durable.closed(row)

    def _expire(self, now: float) -> None:
        kept = [r for r in self._closed if r.closed_at is not None and now - r.closed_at <= self._keep_finished_s]
        kept = kept[-self._max_finished:]
        if len(kept) != len(self._closed):
            self._closed = kept
            self._version += 1
            self._expirations += 1

    def version(self) -> int:
        """Changes whenever ``collect()`` may return something new (for ``exposition.CachedSource``)."""
        with self._lock:
            self._expire(self._clock())
            return self._version

    def close(self) -> None:
        """Shutdown, after the sampler stopped. With a database (``state_dir``) open runs stay open: the last
        checkpoint keeps them and the next start restores them (a run spanning a restart is one run);
        without one they are closed as ``exporter_stopped`` at their last point. A finishing run is closed
        as ``finished``; runs that never pushed training progress are dropped. Rows not written yet are
        tried once more; what cannot be written in time stays in the database. Returns within a few seconds
        whatever the file system does."""
        keep_open = self._durable.store is not None
        with self._lock:
            self._version += 1
            for run in list(self._active.values()):
                if run.tentative:
                    del self._active[run.run_id]
                    continue
                if run.status == "finishing":
                    self._close(run, "finished")
                elif not keep_open:
                    # Counters are known as of the last point: the energy after it has no tokens yet.
                    run.e = max(min(run.last_point_t, run.acc.t), run.s)
                    run.notes.append("the exporter stopped while the run was going")
                    self._close(run, "exporter_stopped")
        self._durable.shutdown()  # and says what could not be written in time

    # ------------------------------------------------------------------------------------------------
    # files

    def check_writable(self) -> str | None:
        """None when the runs CSV and its summaries directory can be written, else one line saying what is
        wrong and what to do (the exporter logs it at start-up). Creates the directories, writes nothing
        else."""
        return files.check_writable(self.csv_path) if self.csv_path is not None else None

