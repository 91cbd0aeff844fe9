"""The sampler thread and the immutable snapshot it publishes.

Every ``--collector.interval`` the sampler runs each enabled collector (timing it, catching its failure so
the others keep working), builds the self-metrics, and publishes one frozen ``Snapshot``. Publishing is a
single reference assignment, so readers (the /metrics handler, the run ledger, ``top``) always see one
consistent sample without locks. The scrape path must only ever read ``Sampler.snapshot``. The snapshot
and the GPU states it carries are plain values (``core.state``): their readers need nothing of this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.core.health import XidEvent
from gpu_energy_exporter.core.metrics import add, define
from gpu_energy_exporter.core.state import CollectorResult, GPUState, ServingSession, SlurmJob, Snapshot

log = logging.getLogger(__name__)

COLLECTOR_SUCCESS = define(
    "collector", "success", "gauge",
    "1 if the collector's last update succeeded, 0 if it failed or had nothing to read.",
    ["collector"], collector="exporter",
)
COLLECTOR_DURATION = define(
    "collector", "duration_seconds", "gauge", "Time the collector's last update took.",
    ["collector"], collector="exporter", unit="seconds",
)
SNAPSHOT_TIMESTAMP = define(
    "snapshot", "timestamp_seconds", "gauge",
    "Unix time at which the snapshot served on /metrics was taken.", collector="exporter", unit="seconds",
)

_STILL_RUNNING = "update still running (slow or hung driver?); serving its last result"


@dataclass(frozen=True)
class _Outcome:
    families: list[Metric]
    ok: bool
    error: str
    duration_s: float


class _Runner:
    """Runs one collector's ``update`` on a long-lived thread of its own, one call at a time."""

    def __init__(self, collector: Collector) -> None:
        self._c = collector
        self._go = threading.Event()
        self._done = threading.Event()
        self._busy = False
        self._started = 0.0
        self._thread: threading.Thread | None = None
        self.latest: _Outcome | None = None  # the last finished update

    def busy(self) -> bool:
        return self._busy

    def running_for(self) -> float:
        return time.perf_counter() - self._started if self._busy else 0.0

    def start(self) -> None:
        """Start an update unless one is still running; a collector that ``runs_inline`` is updated now, on
        the calling thread."""
        if self._busy:
            return
        if self._c.runs_inline():
            self._done.clear()
            self._update()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"collector-{self._c.name}", daemon=True)
            self._thread.start()
        self._busy = True
        self._done.clear()
        self._started = time.perf_counter()
        self._go.set()

    def wait(self, timeout: float) -> _Outcome | None:
        self._done.wait(timeout)
        return self.latest

    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            self._update()

    def _update(self) -> None:
        start = time.perf_counter()
        try:
            out = _Outcome(list(self._c.update()), True, "", 0.0)
        except NoData as exc:
            log.debug("collector %s: no data: %s", self._c.name, exc)
            out = _Outcome(list(exc.families), False, "", 0.0)
        except Exception as exc:  # noqa: BLE001 - one collector must never take the others down
            out = _Outcome([], False, f"{type(exc).__name__}: {exc}", 0.0)
        self.latest = _Outcome(out.families, out.ok, out.error, time.perf_counter() - start)
        self._busy = False
        self._done.set()


def _inline(c: Collector) -> bool:
    return c.runs_inline()


class Sampler:
    """Runs collectors on a fixed period in one daemon thread and publishes snapshots."""

    def __init__(
        self,
        collectors: Sequence[Collector],
        interval: float,
        *,
        gpu_states: Callable[[], tuple[GPUState, ...]] | None = None,
        xid_events: Callable[[], tuple[XidEvent, ...]] | None = None,
        slurm_jobs: Callable[[], tuple[SlurmJob, ...] | None] | None = None,
        serving: Callable[[], tuple[ServingSession, ...] | None] | None = None,
        clock: Callable[[], float] = time.time,
        wait_budget: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._collectors = list(collectors)
        self._interval = interval
        self._gpu_states = gpu_states
        self._xid_events = xid_events  # recent critical Xids (the health collector), carried to the ledger
        self._slurm_jobs = slurm_jobs  # the Slurm jobs holding GPUs (the slurm collector), carried to the ledger
        self._serving = serving  # the local inference servers' sessions (the inference collector), to the ledger
        self._clock = clock
        self._monotonic = monotonic  # the clock of the GPU collector's read times (GPUState.read_at)
        self._snapshot: Snapshot | None = None
        self._seq = 0
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and sample_soon()
        self._soon = False  # an early sample was asked for (sample_soon)
        self._thread: threading.Thread | None = None
        self._last_errors: dict[str, str] = {}
        self._runners = {c.name: _Runner(c) for c in self._collectors}
        #: how long one sample waits for its collectors (a slower one delivers at a later sample)
        self._wait_budget = max(0.5, min(interval, 5.0)) if wait_budget is None else wait_budget

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def waiting_for(self) -> list[str]:
        """Collectors that have not finished a single update yet (e.g. NVML hanging at start-up)."""
        return [name for name, r in self._runners.items() if r.latest is None]

    def add_listener(self, fn: Callable[[Snapshot], None]) -> None:
        """Call ``fn(snapshot)`` on the sampler thread after each publish (must be quick)."""
        self._listeners.append(fn)

    def sample_once(self) -> Snapshot:
        """Run every collector (each on its own thread, in parallel) and publish one snapshot.

        Waits for the collectors at most ``wait_budget`` seconds. A collector still busy then (a slow or
        hung driver) is reported as failed with its last families kept, and its result is used when it
        arrives: one stuck collector never holds up the others."""
        self._soon = False  # this sample serves any early one asked for until now
        deadline = time.monotonic() + self._wait_budget
        names = {c.name for c in self._collectors}
        first = [c for c in self._collectors if not set(c.depends_on) & names]
        # the collectors on threads of their own first: the inline ones run on this thread meanwhile
        for c in sorted(first, key=_inline):
            self._runners[c.name].start()
        for c in first:
            self._runners[c.name].wait(max(0.0, deadline - time.monotonic()))
        # Dependents (they read the state of the collectors above) start once those finished or timed out.
        for c in sorted(self._collectors, key=_inline):
            if c not in first:
                self._runners[c.name].start()
        families: list[Metric] = []
        results: list[CollectorResult] = []
        for c in self._collectors:
            runner = self._runners[c.name]
            out = runner.wait(max(0.0, deadline - time.monotonic()))
            if out is None:  # never finished an update yet
                ok, err, duration, fams = False, _STILL_RUNNING, runner.running_for(), []
            elif runner.busy():
                ok, err, duration, fams = False, _STILL_RUNNING, runner.running_for(), out.families
            else:
                ok, err, duration, fams = out.ok, out.error, out.duration_s, out.families
            families.extend(fams)
            self._log_transition(c.name, err)
            results.append(CollectorResult(c.name, ok, duration, err))
        success, dur = COLLECTOR_SUCCESS.family(), COLLECTOR_DURATION.family()
        for r in results:
            add(success, [r.name], 1.0 if r.success else 0.0)
            add(dur, [r.name], r.duration_s)
        now, mono = self._clock(), self._monotonic()
        ts = SNAPSHOT_TIMESTAMP.family()
        add(ts, [], now)
        families.extend([success, dur, ts])
        self._seq += 1
        snap = Snapshot(
            seq=self._seq,
            timestamp=now,
            families=tuple(families),
            results=tuple(results),
            gpus=self._gpu_states() if self._gpu_states else (),
            xid_events=self._xid_events() if self._xid_events else (),
            slurm_jobs=self._slurm_jobs() if self._slurm_jobs else None,
            serving=self._serving() if self._serving else None,
            monotonic=mono,
        )
        self._snapshot = snap
        for fn in self._listeners:
            try:
                fn(snap)
            except Exception:  # noqa: BLE001
                log.exception("snapshot listener %r failed", fn)
        return snap

    def _log_transition(self, name: str, err: str) -> None:
        """Log a collector's failure when it starts or changes, and its recovery: never once per tick."""
        prev = self._last_errors.get(name, "")
        if err and err != prev:
            log.error("collector %s failed: %s", name, err)
        elif not err and prev:
            log.info("collector %s recovered", name)
        self._last_errors[name] = err

    def sample_soon(self) -> None:
        """Take a sample now rather than at the next tick (any thread; cheap): a run started or finished, and
        the energy counter read at its edge must be taken at the edge, not up to an interval later (issue
        28). Requests while a sample is being taken are served by one sample right after it; the regular
        ticks go on (one that would fall within ``MIN_EARLY_GAP_S`` of the early sample is skipped)."""
        self._soon = True
        self._wake.set()

    def soon_pending(self) -> bool:
        """Whether an early sample was asked for and not taken yet."""
        return self._soon

    #: A regular tick this close after an early sample is skipped (the early one served it).
    MIN_EARLY_GAP_S = 0.25

    def _run(self, first: threading.Event | None = None) -> None:
        self.sample_once()
        if first is not None:
            first.set()
        next_tick = time.monotonic() + self._interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_tick - time.monotonic()))
            if self._stop.is_set():
                break
            self._wake.clear()
            early = self._soon
            self.sample_once()
            now = time.monotonic()
            if early and next_tick - now > self.MIN_EARLY_GAP_S:
                continue  # an early sample: the schedule goes on as it was
            next_tick += self._interval
            if next_tick < now:  # fell behind (slow driver): skip missed ticks, no burst
                next_tick = now + self._interval

    def start(self, first_sample_timeout: float = 5.0) -> bool:
        """Run in a thread, taking the first snapshot at once. Waits up to ``first_sample_timeout`` for it
        (so a scrape right after start-up is not empty) but never longer: a driver that hangs at start-up
        must not keep the HTTP port closed (liveness probes would kill the exporter in a loop). Returns
        whether the first snapshot was published in time."""
        first = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first,), name="sampler", daemon=True)
        self._thread.start()
        if not first.wait(first_sample_timeout):
            log.warning("the first sample is taking more than %gs (slow or hung GPU driver?); serving "
                        "anyway, /-/ready answers 503 until it completes", first_sample_timeout)
            return False
        return True

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                # A collector is stuck in a call (a hung GPU driver): closing it would hang too.
                log.warning("sampler still busy after %gs (slow or hung driver?); exiting without closing "
                            "collectors", timeout)
                return
        # Dependents first: a collector may use what another one opened (the health collector's event
        # thread waits in NVML, which the gpu collector shuts down).
        for c in reversed(self._collectors):
            if self._runners[c.name].busy():
                log.warning("collector %s is still in an update (slow or hung driver?); not closing it", c.name)
                continue
            try:
                c.close()
            except Exception:  # noqa: BLE001
                log.exception("closing collector %s failed", c.name)
