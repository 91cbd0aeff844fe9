"""The run ledger's database (issue 30): how long 256 open runs take to restore, what a checkpoint of them
costs (and how long it holds the ledger's lock), and whether the store's thread keeps up with 200 ranks
pushing every second.

In process, on real files in a temporary directory (the disk this runs on), through ``RunLedger`` with its
real store thread and file writer; 8 GPUs sampled every second at 300 W.

- **restore**: 256 open runs (the ledger's default bound), 32 on each GPU, 2 ranks each pushing tokens,
  samples, steps and loss every second (8 series per run), after 2 minutes (timelines of 120 points, every
  series' recent-points window full) and with their timelines at the ledger's bound (2,000 points, any run
  longer than 2,000 snapshots): the ledger saved and closed, then a new ``RunLedger`` opened on the database
  (open, read, decode, restore) timed.
- **checkpoint**: one full batch of those 256 runs: the CPU time the ledger's lock is held for the longest run
  and for all of them (one run at a time), the copy and JSON (wall) and the SQLite commit with its fsync
  (wall) on the store's thread; the timelines are written once a minute, the rest every checkpoint.
- **200 ranks**: 25 runs of 8 ranks pushing 4 points each every second (800 points/s) in real time for 30 s,
  a run closing and a new one starting every 2 s (rows), checkpoints every 5 s: the store thread's busy time
  per second, the longest time a closed run waited for its row to be committed, and the largest backlog.
  And a burst: 1,000 runs closing at once, the rows per second the store commits.

Not part of ``python -m bench``: ``python -m bench.ledger_store`` (about two minutes).
"""

from __future__ import annotations

import math
import os
import shutil
import sqlite3
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity, GPUReading, GPUState, Snapshot
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.otlp.store import AcceptedPoint

T0 = 1_700_000_000.0
GPUS = [f"GPU-00000000-0000-4000-8000-{i:012d}" for i in range(8)]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _snapshot(t: float, seq: int) -> Snapshot:
    gpus = []
    for i, uuid in enumerate(GPUS):
        identity = GPUIdentity(index=i, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=f"0:{i}",
                               architecture="hopper", compute_capability="9.0", energy_method=ENERGY_METHOD_COUNTER,
                               power_usage_is_average=True)
        reading = GPUReading(timestamp=t, power_instant_w=300.0, memory_used_bytes=40 << 30,
                             memory_total_bytes=80 << 30)
        gpus.append(GPUState(identity=identity, up=True, reading=reading, energy_j=300.0 * (t - T0 + 1000),
                             energy_resets=0, last_good=t, idle_power_w=60.0, idle_power_source="flag"))
    return Snapshot(seq=seq, timestamp=t, families=(), results=(), gpus=tuple(gpus))


def _points(run_id: str, t: float, start: float, finished: bool = False, ranks: int = 8,
            gpu: int | None = None) -> list[AcceptedPoint]:
    """Each rank's tokens, samples, steps and loss at ``t``; rank r on GPU r (or all on ``gpu``)."""
    out = []
    for rank in range(ranks):
        labels = {"run_id": run_id, "rank": str(rank), "gpu_uuid": GPUS[rank % len(GPUS) if gpu is None else gpu]}
        k = t - start
        for name, value in (("training_tokens_total", 1000.0 * k), ("training_samples_total", 4.0 * k),
                            ("training_steps_total", math.floor(k)), ("training_loss", 2.0 / (1 + k))):
            kind = "counter" if name.endswith("_total") else "gauge"
            out.append(AcceptedPoint(run_id, name, labels, value, t, kind))  # type: ignore[arg-type]
        if finished:
            out.append(AcceptedPoint(run_id, "training_run_finished", labels, 1.0, t, "gauge"))  # type: ignore[arg-type]
    return out


def _ledger(tmp: Path, clock: Any, **kw: Any) -> RunLedger:
    return RunLedger(str(tmp / "runs.csv"), warmup_s=0.0, stale_after_s=3600.0, clock=clock,
                     state_dir=str(tmp / "state"), max_active_runs=1 << 20, max_active_per_client=1 << 20,
                     new_runs_per_client_per_minute=1e9, finished_runs_per_client_per_minute=1e9, **kw)


def restore_figures(seconds: int, pad_timeline: bool) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="ledger-store-"))
    clock = Clock(T0)
    ledger = _ledger(tmp, clock, journal_interval_s=1e9)
    runs = [f"run-{i:03d}" for i in range(256)]
    for i in range(seconds + 1):
        t = T0 + i
        clock.t = t
        for k, run_id in enumerate(runs):
            ledger.on_points(_points(run_id, t, T0, ranks=2, gpu=k % len(GPUS)))
        ledger.on_snapshot(_snapshot(t, i))
    if pad_timeline:
        with ledger._lock:
            for run in ledger._active.values():
                pts = run.timeline.points
                while len(run.timeline.points) < run.timeline.max_points - 1:
                    run.timeline.points.extend(pts[: run.timeline.max_points - 1 - len(run.timeline.points)])
    timeline = len(next(iter(ledger._active.values())).timeline.points)
    # one full checkpoint, timed by parts
    durable = ledger._durable
    held: list[float] = []
    lock = ledger._lock

    class Timed:
        def __enter__(self) -> None:
            lock.acquire()
            self.t = time.thread_time()  # CPU of this thread: a loaded machine's preemption is not the lock's

        def __exit__(self, *exc: object) -> None:
            held.append(time.thread_time() - self.t)
            lock.release()

    assert durable.store is not None
    figures: dict[str, float] = {}
    durable._timeline_saved = {}  # the first checkpoint saves every timeline, the next ones (within a minute) none
    for kind in ("with_timelines", "steady"):
        held.clear()
        ledger._lock = Timed()  # type: ignore[assignment]
        t0 = time.perf_counter()
        batch = durable._build(True)
        figures[f"build_{kind}_ms"] = (time.perf_counter() - t0) * 1e3
        ledger._lock = lock
        figures[f"lock_max_{kind}_ms"] = max(held) * 1e3
        figures[f"lock_total_{kind}_ms"] = sum(held) * 1e3
        t0 = time.perf_counter()
        durable.store.commit(batch)
        durable._batch_done(batch)
        figures[f"commit_{kind}_ms"] = (time.perf_counter() - t0) * 1e3
        figures[f"state_{kind}_mb"] = sum(len(s) + len(t or "") for _, _, s, t in batch.open_runs.values()) / 1e6
    ledger.close()
    clock.t += 30.0  # a restart 30 s later
    t0, cpu0 = time.perf_counter(), time.process_time()
    again = _ledger(tmp, clock)
    restore, restore_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    restored = len(again._active)
    again.close()
    db_bytes = (tmp / "state" / "runs.db").stat().st_size
    shutil.rmtree(tmp, ignore_errors=True)
    assert restored == 256, restored
    return {"timeline": timeline, "restore_s": restore, "restore_cpu_s": restore_cpu, "db_mb": db_bytes / 1e6,
            **figures}


def ranks_figures(duration_s: float = 30.0) -> dict[str, float]:
    """200 ranks (25 runs of 8, rank r on GPU r) pushing every second in real time; a run closing and a new
    one every 2 s."""
    tmp = Path(tempfile.mkdtemp(prefix="ledger-store-"))
    ledger = _ledger(tmp, time.time, background_writes=True)
    durable = ledger._durable
    busy = [0.0]
    build, commit = durable._build, durable.store.commit  # type: ignore[union-attr]

    def timed_build(full: bool) -> Any:
        t0 = time.perf_counter()
        try:
            return build(full)
        finally:
            busy[0] += time.perf_counter() - t0

    def timed_commit(batch: Any) -> None:
        t0 = time.perf_counter()
        try:
            commit(batch)
        finally:
            busy[0] += time.perf_counter() - t0

    durable._sw._build = timed_build  # type: ignore[union-attr]
    durable.store.commit = timed_commit  # type: ignore[union-attr,method-assign]
    starts = {f"r{i}": time.time() for i in range(25)}
    waited: list[float] = []
    backlog = 0
    closed_at: dict[str, float] = {}
    stop = threading.Event()
    n_next = 25
    t_start = time.time()
    seq = 0
    busy0 = busy[0]
    while time.time() - t_start < duration_s:
        tick = time.time()
        ledger.on_snapshot(_snapshot(tick, seq))
        seq += 1
        closing = None
        if seq % 2 == 0:
            closing = min(starts)
        for run_id, start in list(starts.items()):
            ledger.on_points(_points(run_id, tick, start, finished=run_id == closing))
        if closing is not None:
            closed_at[closing] = tick
            del starts[closing]
            starts[f"r{n_next}"] = time.time()
            n_next += 1
        with ledger._lock:
            backlog = max(backlog, len(ledger._pending))
        stop.wait(max(0.0, 1.0 - (time.time() - tick)))
    elapsed = time.time() - t_start
    busy_per_s = (busy[0] - busy0) / elapsed
    ledger.close()
    with sqlite3.connect(tmp / "state" / "runs.db") as db:
        for run_id, recorded in db.execute("SELECT run_id, recorded_unix FROM runs"):
            if run_id in closed_at:
                waited.append(recorded - closed_at[run_id])
        rows = db.execute("SELECT count(*) FROM runs").fetchone()[0]
    shutil.rmtree(tmp, ignore_errors=True)
    return {"points_per_s": 25 * 8 * 4, "busy_ms_per_s": busy_per_s * 1e3, "rows": rows,
            "row_wait_max_s": max(waited) if waited else math.nan,
            "row_wait_median_s": statistics.median(waited) if waited else math.nan, "backlog_max": backlog}


def burst_figures(n: int = 1000) -> dict[str, float]:
    """``n`` runs closing at once: rows per second into the database."""
    tmp = Path(tempfile.mkdtemp(prefix="ledger-store-"))
    clock = Clock(T0)
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=3600.0, clock=clock, state_dir=str(tmp / "state"),
                       max_active_runs=1 << 20, max_active_per_client=1 << 20, new_runs_per_client_per_minute=1e9,
                       finished_runs_per_client_per_minute=1e9, journal_interval_s=1e9)
    ledger.on_snapshot(_snapshot(T0, 0))
    for i in range(n):
        ledger.on_points(_points(f"b{i}", T0 + 0.5, T0 + 0.5, ranks=1))
    clock.t = T0 + 1
    ledger.on_snapshot(_snapshot(T0 + 1, 1))
    for i in range(n):
        ledger.on_points(_points(f"b{i}", T0 + 1, T0 + 0.5, finished=True, ranks=1))
    t0 = time.perf_counter()
    clock.t = T0 + 2
    ledger.on_snapshot(_snapshot(T0 + 2, 2))
    sw = ledger._durable._sw
    assert sw is not None
    sw.wait(sw.kick(), 120.0)
    took = time.perf_counter() - t0
    ledger.close()
    with sqlite3.connect(tmp / "state" / "runs.db") as db:
        rows = db.execute("SELECT count(*) FROM runs").fetchone()[0]
    shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "seconds": took, "rows_per_s": rows / took}


def main() -> None:
    print("run ledger database (bench/ledger_store.py)")
    print()
    print("| 256 open runs (2 ranks, 8 series each) | timeline points | restore: wall (CPU) | checkpoint | lock held "
          "(CPU): longest run / all runs | build (copy + JSON) | commit (fsync) | JSON written |")
    print("|---|---|---|---|---|---|---|---|")
    for label, seconds, pad in (("after 2 min", 120, False), ("timelines at the bound", 120, True)):
        f = restore_figures(seconds, pad)
        for kind, what in (("with_timelines", "with the timelines (once a minute)"), ("steady", "the others")):
            first = kind == "with_timelines"
            restore = f"**{f['restore_s']:.2f} s** ({f['restore_cpu_s']:.2f} s)" if first else ""
            print(f"| {label if first else ''} | {f['timeline'] if first else ''} | {restore} | {what} | "
                  f"{f[f'lock_max_{kind}_ms']:.2f} / {f[f'lock_total_{kind}_ms']:.0f} ms | "
                  f"{f[f'build_{kind}_ms']:.0f} ms | {f[f'commit_{kind}_ms']:.0f} ms | "
                  f"{f[f'state_{kind}_mb']:.1f} MB |")
    print()
    r = ranks_figures()
    print("| 200 ranks pushing every second (25 runs x 8, 800 points/s), 30 s | value |")
    print("|---|---|")
    print(f"| store thread busy, ms per second | **{r['busy_ms_per_s']:.1f}** |")
    print(f"| rows written (a run closing every 2 s) | {r['rows']} |")
    print(f"| closed run to its row committed, median / max | {r['row_wait_median_s'] * 1e3:.0f} / "
          f"{r['row_wait_max_s'] * 1e3:.0f} ms |")
    print(f"| largest backlog (rows waiting) | {r['backlog_max']} |")
    b = burst_figures()
    print(f"| burst: {b['rows']} runs closing at once, rows committed per second | **{b['rows_per_s']:,.0f}** "
          f"({b['seconds']:.2f} s) |")
    print()
    print(f"load average during the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
