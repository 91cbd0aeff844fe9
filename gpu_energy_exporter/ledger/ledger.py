"""The run ledger: per training run energy, tokens, J/token, power, VRAM and CO2, without Prometheus.

Fed from two sides: ``on_point`` receives every point the OTLP store accepted (request threads) and
``on_snapshot`` every sampler snapshot (sampler thread). A run lives from its first point until every
rank that pushed has sent ``training_run_finished 1`` (or until nothing was pushed for ``stale_after``,
in which case it ends at its last point). Then one row is appended to the CSV and a JSON summary is
written beside it (``<csv dir>/runs/<run id>.json``), both atomically (temp file, fsync, rename).
``collect()`` serves per-run series on /metrics; ``runs()`` / ``run(run_id)`` feed the JSON API
(``daemon/api.py``: ``/api/v1/runs``, ``/api/v1/run?id=``) that ``top``, ``report`` and ``runs --url`` read.

How the figures are made: the package's docstring (``gpu_energy_exporter.ledger``) and docs/ledger.md.

This module never calls NVML or reads hardware, never integrates power into energy, and never raises
into the sampler or request threads: a failing write is logged and counted, the run is kept and retried
with back-off on the sampler thread, and once more at shutdown.

This module is the ledger's driver: the lock, the snapshot history, who holds which GPU, when runs open
and close, the write-retry queue and what /metrics and the JSON API get. The arithmetic lives beside it:
point ingestion and the accumulator's moves in ``runs``, interval accounting in ``accounting``, figures in
``summary``, snapshot framing in ``frames``, files in ``files``, series in ``specs``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpu_energy_exporter.core.runs_schema import SUMMARY_SCHEMA
from gpu_energy_exporter.core.state import Snapshot
from gpu_energy_exporter.ledger import accounting, files, runs, specs
from gpu_energy_exporter.ledger.files import append_csv_row, iso_utc
from gpu_energy_exporter.ledger.frames import Frame, frame_of
from gpu_energy_exporter.ledger.runs import PointLike, Run
from gpu_energy_exporter.ledger.split import Holding
from gpu_energy_exporter.ledger.summary import details, fmt, local_check, peak_flops, summarize, summary_path
from gpu_energy_exporter.reference.gpu_specs import lookup_peak_flops

log = logging.getLogger(__name__)


CarbonSource = Callable[[], "tuple[float, float]"]


class RunLedger:
    """Per-run energy accounting. Thread-safe: one lock; file writes happen outside it.

    ``csv_path``: ``--runs.csv`` (None keeps runs in memory only). ``warmup_s``: ``--runs.warmup``.
    ``stale_after_s``: ``--runs.stale-after``. ``carbon``: returns (grid intensity g/kWh, PUE), called
    once per snapshot on the sampler thread; None means no CO2 figures. ``clock``: wall time (staleness,
    how long finished runs are kept).
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
        keep_finished_s: float = 900.0,
        max_finished_runs: int = 100,
        max_active_runs: int = 256,
        late_window_s: float = 120.0,
    ) -> None:
        if warmup_s < 0 or stale_after_s <= 0:
            raise ValueError("warmup_s must be >= 0 and stale_after_s > 0")
        self.csv_path = csv_path
        self.warmup_s = warmup_s
        self.stale_after_s = stale_after_s
        self._carbon = carbon
        self._clock = clock
        self._timeline_points = timeline_points
        self._keep_finished_s = keep_finished_s
        # Bounds memory under heavy run churn (each closed run keeps its timeline for report/top);
        # the CSV and JSON files keep every run.
        self._max_finished = max_finished_runs
        self._max_active = max_active_runs
        self._late_window_s = late_window_s
        # Snapshots are kept long enough to replay a stale run from its last point.
        self._history_s = stale_after_s + late_window_s
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()
        self._history: deque[Frame] = deque()
        self._active: dict[str, Run] = {}
        self._closed: list[Run] = []  # finished, kept for keep_finished_s
        self._finished_counts: dict[str, float] = dict.fromkeys(specs.STATUSES, 0.0)
        self._rejected = 0.0
        self._evicted = 0.0
        self._write_errors = 0.0
        # Closed runs whose files could not be written: retried with back-off, and at shutdown.
        self._pending: list[Run] = []
        self._max_pending = max(1000, max_finished_runs)
        # Who uses which GPU, by snapshot time (ledger_split.Holding), rebuilt when runs change.
        self._holders_gen = 0
        self._peak_rows: dict[str, dict[str, float]] = {}  # GPU model -> precision -> peak FLOP/s
        self._holders_cache: dict[float, dict[str, list[Holding]]] = {}
        self._holders_cache_gen = -1
        # Energy of each GPU charged to no run, settled when its interval leaves the snapshot history
        # (no late point can change who used the GPU then): uuid key -> (gpu index, uuid, joules).
        self._unattributed: dict[str, tuple[str, str, float]] = {}
        self._carbon_error_logged = False
        self._last_reject_log = -math.inf
        self._version = 0  # bumped whenever what collect() returns may have changed
        # Parts of each live summary's stamp (with the run's own points and _holders_gen): bumped by every
        # snapshot counted and every expiry of finished runs.
        self._snapshots = 0
        self._expirations = 0

    # ------------------------------------------------------------------------------------------------
    # points (request threads)

    def on_point(self, point: PointLike) -> None:
        """Store listener: ``TrainingStore.add_listener(ledger.on_point)``."""
        self.on_points((point,))

    #: points recorded per lock acquisition in ``on_points`` (a scrape of the ledger waits for one chunk)
    POINTS_CHUNK = 256

    def on_points(self, points: Sequence[PointLike]) -> None:
        """Store batch listener (``TrainingStore.add_batch_listener``): ``on_point`` for each of one
        request's points, taking the lock once per ``POINTS_CHUNK`` points."""
        record = self._record_locked
        for start in range(0, len(points), self.POINTS_CHUNK):
            with self._lock:
                received = self._clock()  # one request's points arrived together
                for point in points[start:start + self.POINTS_CHUNK]:
                    count = getattr(point, "count", None)
                    record(point.run_id, point.name, point.labels, point.value, point.time,
                           float(count) if count is not None else None, getattr(point, "key", None), received)

    def record(self, run_id: str, name: str, labels: Mapping[str, str], value: float, t: float, *,
               count: float | None = None) -> None:
        """One accepted point: ``value`` cumulative for counters (the histogram's sum, with ``count``),
        the value for gauges; ``t`` in Unix seconds."""
        with self._lock:
            self._record_locked(run_id, name, labels, value, t, count)

    def _record_locked(self, run_id: str, name: str, labels: Mapping[str, str], value: float, t: float,
                       count: float | None, key: runs.LabelKey | None = None, received: float | None = None) -> None:
        """``key``, ``received``: ``labels`` as their sorted items, the clock's time, when the caller has them."""
        if not run_id or not math.isfinite(value) or not math.isfinite(t):
            return
        progress = name in runs.COUNTERS or name == runs.HISTOGRAM
        self._version += 1
        run = self._active.get(run_id)
        if run is None:
            run = self._new_run(run_id, name, value, t)
            if run is None:
                return
        gpus_before = len(run.gpus)
        end_before = run.e
        runs.apply_point(run, name, labels, value, t, count, self._clock() if received is None else received, key)
        if len(run.gpus) != gpus_before:
            self._holders_gen += 1  # a GPU named for the first time
        if run.tentative:
            if not progress:
                return
            # The run's first training progress: it becomes a run. Its first point was stamped by the
            # trainer when it was collected, possibly before snapshots already received: count those
            # now that the run's GPUs are known, and give runs sharing its GPUs their new share.
            run.tentative = False
            self._holders_changed(run, run.s)
            runs.replay(run, run.acc, self._history, run.s, math.inf, self._holders, live=True)
            log.info("run %s started (first point at %s)", run_id, iso_utc(run.s))
            return
        if len(run.gpus) != gpus_before:
            self._holders_changed(run, run.s)
        elif run.e != end_before:
            self._holders_changed(run, min(x for x in (run.e, end_before) if x is not None))

    def _new_run(self, run_id: str, name: str, value: float, t: float) -> Run | None:
        previous = [r for r in self._closed if r.run_id == run_id]
        if previous and not runs.resumes(previous[-1], name, value, t):
            return None
        if len(self._active) >= self._max_active:
            # Runs that never pushed training progress give way first (oldest push first): a flood of
            # run ids without progress (e.g. training_run_finished only) cannot keep a real run out.
            idle = [r for r in self._active.values() if r.tentative]
            if idle:
                victim = min(idle, key=lambda r: r.last_point_received)
                del self._active[victim.run_id]
                self._evicted += 1
        if len(self._active) >= self._max_active:
            self._rejected += 1
            now = self._clock()
            if now - self._last_reject_log > 60:
                self._last_reject_log = now
                log.warning("run ledger: already tracking %d active runs; ignoring new run %r (runs end on "
                            "training_run_finished or after --runs.stale-after)", self._max_active, run_id)
            return None
        run = Run(run_id, t, self.warmup_s, not previous, self._timeline_points, self._clock())
        self._active[run_id] = run
        return run

    # ------------------------------------------------------------------------------------------------
    # snapshots (sampler thread)

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Sampler listener: ``Sampler.add_listener(ledger.on_snapshot)``."""
        intensity = pue = None
        if self._carbon is not None:
            try:
                intensity, pue = self._carbon()
            except Exception as exc:  # noqa: BLE001 - a carbon source bug must not stop the ledger
                if not self._carbon_error_logged:
                    log.warning("run ledger: carbon intensity unavailable (%s); CO2 figures will be missing", exc)
                    self._carbon_error_logged = True
        frame = frame_of(snapshot, intensity, pue)
        done: list[Run] = []
        with self._lock:
            if self._history and frame.t <= self._history[-1].t:
                return  # a repeated or out-of-order snapshot adds nothing
            self._version += 1
            self._snapshots += 1
            prev = self._history[-1] if self._history else None
            self._history.append(frame)
            for key, gf in frame.gpus.items():
                if key not in self._unattributed:
                    self._unattributed[key] = (str(gf.index), gf.uuid, 0.0)
            while len(self._history) > 1 and self._history[0].t < frame.t - self._history_s:
                self._settle(self._history[0], self._history[1])
                self._history.popleft()
            now = self._clock()
            for run in list(self._active.values()):
                if run.tentative:
                    if run.e is not None or now - run.last_point_received > self.stale_after_s:
                        del self._active[run.run_id]  # never a run: no row, no series
                    continue
                if prev is not None:
                    runs.advance(run, prev, frame, self._holders, self._late_window_s)
            for run in list(self._active.values()):
                if run.tentative:
                    continue
                if run.e is None and now - run.last_point_received > self.stale_after_s:
                    run.status = "stale"
                    run.e = run.last_point_t
                    log.warning("run %s: nothing pushed for %.0fs; closing it as stale at its last point (%s)",
                                run.run_id, self.stale_after_s, iso_utc(run.e))
                    self._holders_changed(run, run.e)
                if run.e is not None and (frame.t >= run.e or run.status == "stale"):
                    self._close(run, run.status if run.status == "stale" else "finished")
                    done.append(run)
            self._expire(now)
        for run in done:
            self._write(run)
        self._retry_writes(now)

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
        out = runs.holdings(frame, (*self._closed, *self._active.values()))
        if len(self._holders_cache) > 4 * len(self._history) + 16:
            self._holders_cache.clear()
        self._holders_cache[frame.t] = out
        return out

    def _holders_changed(self, run: Run, t: float) -> None:
        """``run`` started, ended or named a GPU at ``t``: runs sharing its GPUs that already counted
        snapshots after ``t`` are recounted from their last checkpoint before it, with the new split."""
        self._holders_gen += 1
        latest = self._history[-1] if self._history else None
        mine = run.parents(latest)
        if not mine:
            return
        for other in self._active.values():
            if other is run or other.tentative or other.acc.t <= t or not (mine & other.parents(latest)):
                continue
            runs.rewind(other, t, self._history, self._holders)

    # ------------------------------------------------------------------------------------------------
    # closing a run

    def _close(self, run: Run, status: str) -> None:
        self._holders_gen += 1
        runs.close_accounts(run, status, self._history, self._holders)
        run.closed_at = self._clock()
        run.summary = self._summary(run)
        del self._active[run.run_id]
        self._closed.append(run)
        self._finished_counts[status] = self._finished_counts.get(status, 0.0) + 1
        s = run.summary
        log.info("run %s %s: %.0fs, %s tokens, %s J, %s J/token", run.run_id, status, s["duration_s"],
                 fmt(s["tokens"]), fmt(s["energy_j"]), fmt(s["j_per_token"]))

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
        """Close every active run and write it: a finishing run as ``finished`` (at its end), the others as
        ``exporter_stopped`` at the last snapshot counted; runs that never pushed training progress are
        dropped. Runs whose earlier writes failed are tried once more. Call once at shutdown, after the
        sampler stopped."""
        done: list[Run] = []
        with self._lock:
            self._version += 1
            for run in list(self._active.values()):
                if run.tentative:
                    del self._active[run.run_id]
                    continue
                if run.status == "finishing":
                    self._close(run, "finished")
                else:
                    run.e = max(run.acc.t, run.s)
                    run.notes.append("the exporter stopped while the run was going")
                    self._close(run, "exporter_stopped")
                done.append(run)
        for run in done:
            self._write(run)
        self._retry_writes(math.inf)
        with self._lock:
            lost = [r.run_id for r in self._pending]
        if lost:
            log.error("run ledger: %d finished run(s) could not be written to %s and are lost at shutdown: %s",
                      len(lost), self.csv_path, ", ".join(lost))

    # ------------------------------------------------------------------------------------------------
    # figures

    def _live_summary(self, run: Run) -> dict[str, Any]:
        """An active run's figures cut at its last point: counters are only known as of the last export,
        so counting energy up to the latest snapshot would charge the tokens of the last export interval
        for energy they have not been reported against yet (J/token too high by up to one interval).

        Kept until the run's stamp changes: a point of the run, a snapshot, or a change of who holds which
        GPU (which recounts runs sharing them); so a scrape recounts only the runs that changed. Returns a
        copy (callers may change it)."""
        stamp = (run.changes, self._snapshots, self._holders_gen, self._expirations)
        memo = run.live_memo
        if memo is None or memo[0] != stamp:
            memo = run.live_memo = (stamp, self._live_summary_now(run))
        return dict(memo[1])

    def _live_summary_now(self, run: Run) -> dict[str, Any]:
        cut = run.last_point_t
        if run.e is None and run.s < cut < run.acc.t:
            base = run.checkpoint_before(cut)
            if base is not None:
                acc = base.copy()
                runs.replay(run, acc, self._history, max(acc.t, run.s), cut, self._holders, live=False)
                acc.t = cut
                return self._summary(run, acc)
        return self._summary(run)

    def _summary(self, run: Run, acc: accounting.Acc | None = None) -> dict[str, Any]:
        latest = self._history[-1] if self._history else None
        precision = run.metadata.get("precision") or ""
        return summarize(run, run.acc if acc is None else acc, warmup_s=self.warmup_s, local=local_check(latest),
                         carbon_configured=self._carbon is not None,
                         peak=peak_flops(run.gpus, latest, precision, self._peak_row),
                         summary_file=summary_path(self.csv_path, run.run_id))

    def _peak_row(self, model: str) -> dict[str, float]:
        """Peak FLOP/s of a GPU model by precision (the bundled table, looked up once per model)."""
        if model not in self._peak_rows:
            row = lookup_peak_flops(model)
            self._peak_rows[model] = dict(row.flops) if row is not None else {}
        return self._peak_rows[model]

    # ------------------------------------------------------------------------------------------------
    # files

    def check_writable(self) -> str | None:
        """None when the runs CSV and its summaries directory can be written, else one line saying what is
        wrong and what to do (the exporter logs it at start-up). Creates the directories, writes nothing
        else."""
        return files.check_writable(self.csv_path) if self.csv_path is not None else None

    def _document(self, run: Run, summary: dict[str, Any]) -> dict[str, Any]:
        """A run's document (``/api/v1/run``, the JSON summary): its summary, GPUs, metadata and timeline."""
        return {"schema": SUMMARY_SCHEMA, "start_unix": run.s, "end_unix": run.e,
                "configured_warmup_s": self.warmup_s, **summary, **details(run)}

    def _write(self, run: Run) -> bool:
        """Write a closed run's JSON summary and CSV row. On failure the run is kept in ``_pending`` and
        retried with back-off (``_retry_writes``), at the latest at shutdown."""
        if self.csv_path is None or run.summary is None:
            return True
        with self._lock:
            summary = dict(run.summary)
            doc = self._document(run, summary)
        with self._write_lock:
            try:
                runs_dir = files.summaries_dir(self.csv_path)
                name, renamed = files.summary_name(runs_dir, run.run_id, run.written_json, run.s)
                if renamed:  # the same run id again (resumed, or reused): the earlier summary is kept
                    summary["summary_file"] = doc["summary_file"] = os.path.join(files.RUNS_DIR, name)
                    with self._lock:
                        if run.summary is not None:
                            run.summary["summary_file"] = summary["summary_file"]
                files.write_json(os.path.join(runs_dir, name), doc)
                run.written_json = name
                append_csv_row(self.csv_path, summary, self._clock)
            except OSError as exc:
                with self._lock:
                    self._write_errors += 1
                    self._version += 1
                    run.write_failures += 1
                    run.next_write_try = self._clock() + files.retry_delay(run.write_failures)
                    first = run not in self._pending
                    if first:
                        self._pending.append(run)
                        if len(self._pending) > self._max_pending:
                            dropped = self._pending.pop(0)
                            log.error("run ledger: more than %d runs waiting to be written; giving up on run %s",
                                      self._max_pending, dropped.run_id)
                if first:
                    log.error("run %s: cannot write the run ledger (%s: %s); the run is kept and retried until "
                              "it is written (at the latest at shutdown). Check that the directory of --runs.csv "
                              "exists and is writable.",
                              run.run_id, getattr(exc, "filename", None) or self.csv_path, exc.strerror or exc)
                return False
        with self._lock:
            if run in self._pending:
                self._pending.remove(run)
                self._version += 1
                log.warning("run %s: written to the run ledger after %d failed attempt(s)", run.run_id,
                            run.write_failures)
        return True

    def _retry_writes(self, now: float) -> None:
        """Retry the pending writes that are due (all of them with ``now = inf``), oldest first."""
        with self._lock:
            due = [r for r in self._pending if r.next_write_try <= now]
        for run in due:
            if not self._write(run):
                break  # the fault is still there: the others wait for their own turn

    # ------------------------------------------------------------------------------------------------
    # reading

    def runs(self) -> list[dict[str, Any]]:
        """Active and recently finished runs (summaries, oldest first); active ones are figured now."""
        with self._lock:
            out = [dict(r.summary) for r in self._closed if r.summary is not None]
            out.extend(self._live_summary(r) for r in self._active.values() if not r.tentative)
        out.sort(key=lambda s: s["start_time"] or "")
        return out

    def run(self, run_id: str) -> dict[str, Any] | None:
        """One run's summary plus its GPUs, metadata and timeline; the active instance if there is one."""
        with self._lock:
            run = self._active.get(run_id)
            if run is None or run.tentative:
                closed = [r for r in self._closed if r.run_id == run_id]
                if not closed:
                    return None
                run = closed[-1]
            summary = dict(run.summary) if run.summary is not None else self._live_summary(run)
            return self._document(run, summary)

    def collect(self) -> list[Metric]:
        """Per-run series and the ledger's self-metrics (a live source of the /metrics collector)."""
        with self._lock:
            self._expire(self._clock())
            # A closed run and a resumed instance of it share the run id: show only the newest.
            by_id: dict[str, tuple[Run, dict[str, Any]]] = {}
            for r in self._closed:
                if r.summary is not None:
                    by_id[r.run_id] = (r, r.summary)
            for r in self._active.values():
                if not r.tentative:
                    by_id[r.run_id] = (r, self._live_summary(r))
            served = [(run_id, r.status, s, specs.counter_values(r.exposed, s)) for run_id, (r, s) in by_id.items()]
            finished = dict(self._finished_counts)
            rejected, errors, evicted = self._rejected, self._write_errors, self._evicted
            pending = len(self._pending)
            unattributed = sorted(self._unattributed.values(), key=lambda x: (len(x[0]), x[0], x[1]))
        return specs.families(served, finished, rejected, errors, evicted, pending, unattributed)
