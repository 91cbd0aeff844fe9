"""Energy with the counter read every ``--collector.energy-interval`` (30 s by default) instead of every sample:
over every 1-minute window, the exposed energy and the energy runs are charged from, against the trace's
exact integral.

In-process, on a frozen fake clock stepped one ``--collector.interval`` (1 s) per sample, so eleven minutes of
a fake machine take seconds and every figure is exact arithmetic on the scenario (no machine load enters).
Four fake H100s, each with its own trace (``TRACES``: the accuracy benchmark's steady, bursty, phase-locked and
idle-gap traces, and long training/evaluation phases that change the power between two counter reads). Two
GPU collectors sample the same GPUs at the same instants: the default schedule, and the counter read every
sample (the exporter before the schedule). Between two counter reads the default schedule apportions energy
by the driver's ~1 s average power, scaled by what the counter said of it over the last span
(``core.apportion``). The cost model is not needed here (it changes what a read costs, not what it returns).

The main table's windows start past the start-up reads; a last table covers the first minute, with the first
sample's counter read and the read confirming it 0.4 s apart on the driver's clock (a loaded machine; the
total must be timed by the read it came from), in 10 s windows (runs that start with the exporter).

Never asserts a figure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bench import harness
from bench.accuracy import BURSTY, _idle_gaps
from bench.harness import Context, Table, fakenvml, pct

TITLE = ("Energy with the counter on its own cadence (targets: within 1% of the truth over every 1-minute window, "
         "runs within 0.5% over 60 s)")

EPOCH = 1_750_000_000.0
INTERVAL = 1.0
ENERGY_INTERVAL = 30.0  # the flag's default
WINDOW = 60.0
RUN = 60.0  # the runs of the last column: 60 s each, one every 75 s

TRACES: tuple[tuple[str, fakenvml.PowerTrace], ...] = (
    ("steady 300 W", fakenvml.Constant(300.0)),
    ("bursty steps (311 ms cycle)", BURSTY),
    ("locked to the sensor (50 ms square)", fakenvml.Square(120.0, 680.0, 0.05, 0.6)),
    ("idle gaps (1-2 s)", _idle_gaps()),
    ("phases: 40 s at 620 W, 20 s at 90 W", fakenvml.Steps(((40.0, 620.0), (20.0, 90.0)), repeat=True)),
)


def _collector(lib: Path, clock: Any, energy_interval: float | None) -> Any:
    from gpu_energy_exporter.collectors.gpu import GPUCollector
    from gpu_energy_exporter.devices.nvml import NVMLBackend

    return GPUCollector(lambda: NVMLBackend(str(lib), clock=clock), retry_interval=0.0, gpm=False,
                        interval=INTERVAL, energy_interval=energy_interval, clock=clock, monotonic=clock,
                        power_interval=3600.0)


def _series(collector: Any) -> dict[str, float]:
    """The exposed energy counter per GPU label, as /metrics would serve it."""
    out = {}
    for fam in collector.update():
        if fam.name == "gpuenergy_gpu_energy_joules":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["gpu"]] = s.value
    return out


def run(ctx: Context) -> list[Table]:
    duration = ctx.pick(150.0, 660.0)
    gpus = [fakenvml.h100(i, power=trace) for i, (_, trace) in enumerate(TRACES)]
    path = ctx.path("energy-schedule.ini")
    now = [EPOCH + 10.0]

    def write() -> fakenvml.Scenario:
        sc = fakenvml.Scenario(epoch=EPOCH, driver=fakenvml.Driver(frozen_time=now[0]), gpus=gpus)
        sc.write(path)
        return sc

    sc = write()
    old = os.environ.get(fakenvml.SCENARIO_ENV)
    os.environ[fakenvml.SCENARIO_ENV] = str(path)
    clock = lambda: now[0]  # noqa: E731
    scheduled, every = _collector(ctx.lib, clock, ENERGY_INTERVAL), _collector(ctx.lib, clock, None)
    edges = _collector(ctx.lib, clock, ENERGY_INTERVAL)  # + a counter read at each run's edges (as the daemon asks)
    span = int(RUN / INTERVAL)
    runs = [(k, k + span) for k in range(int(40 / INTERVAL), int(duration / INTERVAL) - span, int(75 / INTERVAL))]
    asks = {k + 1 for run in runs for k in run}  # the ledger hears of an edge during the sample after it
    times: list[float] = []
    exposed: dict[str, list[list[float]]] = {"scheduled": [], "every": []}
    charged: list[list[float]] = []
    charged_edges: list[list[float]] = []
    try:
        while now[0] < EPOCH + 10.0 + duration:
            write()
            if len(times) in asks:
                edges.request_counter_read()
            s1, s2 = _series(scheduled), _series(every)
            edges.update()
            times.append(now[0])
            exposed["scheduled"].append([s1.get(str(i), float("nan")) for i in range(len(gpus))])
            exposed["every"].append([s2.get(str(i), float("nan")) for i in range(len(gpus))])
            charged.append([st.energy_j if st.energy_j is not None else float("nan") for st in scheduled.states()])
            charged_edges.append([st.energy_j if st.energy_j is not None else float("nan") for st in edges.states()])
            now[0] += INTERVAL
    finally:
        scheduled.close()
        every.close()
        edges.close()
        if old is None:
            os.environ.pop(fakenvml.SCENARIO_ENV, None)
        else:
            os.environ[fakenvml.SCENARIO_ENV] = old
    table = Table(
        f"Error against the exact integral over every {WINDOW:.0f} s window ({duration:.0f} s simulated, sampled "
        f"every {INTERVAL:g} s): mean |error| (worst, signed)",
        ["trace", f"exposed, counter every {ENERGY_INTERVAL:g} s", "charged to runs (in-process energy)",
         "exposed, counter every sample (before)", f"{RUN:.0f} s runs, counter also read at their edges"],
        [f"Windows start at every sample from t = {ENERGY_INTERVAL:g} s (past the start-up reads); "
         f"{len(times)} samples per GPU. The exposed value is what /metrics serves (driver value plus the "
         "apportioned energy); runs are charged from the in-process energy (monotonic total) on the same grid.",
         f"Last column: runs of {RUN:.0f} s, one every 75 s, charged by a third collector that also reads the "
         "counter at the sample after each run's start and end (the daemon asks for it when a run pushes its first "
         "point or says it finished: GPUCollector.request_counter_read)."],
    )
    worst_exposed = worst_charged = worst_runs = 0.0
    start = next(k for k, t in enumerate(times) if t - times[0] >= ENERGY_INTERVAL)
    width = int(WINDOW / INTERVAL)
    for i, (name, _) in enumerate(TRACES):
        cells = []
        for values in (exposed["scheduled"], charged, exposed["every"]):
            errors = []
            for a in range(start, len(times) - width):
                b = a + width
                true = sc.true_energy_j(i, times[a], times[b])
                errors.append((values[b][i] - values[a][i]) / true - 1.0)
            cells.append(errors)
        run_errors = [(charged_edges[b][i] - charged_edges[a][i]) / sc.true_energy_j(i, times[a], times[b]) - 1.0
                      for a, b in runs]
        worst_exposed = max(worst_exposed, *(abs(e) for e in cells[0]))
        worst_charged = max(worst_charged, *(abs(e) for e in cells[1]))
        worst_runs = max(worst_runs, *(abs(e) for e in run_errors))
        table.add(name, *(_cell(c) for c in cells), _cell(run_errors))
    verdict = Table("Against the targets", ["target", "worst window", "met"])
    verdict.add("exposed energy within 1% over every 1-minute window", pct(worst_exposed, 3),
                "yes" if worst_exposed <= 0.01 else "no")
    verdict.add("runs charged within 0.5% over 60 s (any 60 s window, no read at the edges)", pct(worst_charged, 3),
                "yes" if worst_charged <= 0.005 else "no")
    verdict.add(f"runs charged within 0.5% over 60 s ({len(runs)} runs per trace, counter read at their edges)",
                pct(worst_runs, 3), "yes" if worst_runs <= 0.005 else "no")
    return [table, verdict, _startup(ctx), _windows(ctx)]


#: A loaded machine's samples: each taken up to this many seconds after its tick (a seeded sequence).
LOADED_LATE = 0.6
WAVE = fakenvml.Square(150.0, 650.0, 10.0, 0.5)


def _windows(ctx: Context) -> Table:
    """The exposed counter over 10 s and 60 s windows of a 10 s square wave (150/650 W), on an idle machine
    (every sample on its tick) and on a loaded one (each up to ``LOADED_LATE`` late): what rate() sees."""
    path = ctx.path("energy-schedule-windows.ini")
    duration = ctx.pick(150.0, 660.0)
    table = Table(
        "The exposed counter (gpuenergy_gpu_energy_joules_total) over windows of a 10 s square wave 150/650 W: "
        "mean |error| (worst, signed) against the exact integral",
        ["machine", "10 s windows", "60 s windows", "5 min windows"],
        [f"{duration:.0f} s simulated, counter every {ENERGY_INTERVAL:g} s, windows from every sample after "
         f"{ENERGY_INTERVAL:g} s. Loaded: each sample taken up to {LOADED_LATE:g} s after its tick (seeded), as "
         "on a machine whose sampler thread waits for a core. Windows are measured between two samples' own "
         "times, as a scrape that happens to follow each sample would; what Prometheus' rate() adds "
         "(extrapolation to the window's edges) is not in these figures."],
    )
    old = os.environ.get(fakenvml.SCENARIO_ENV)
    os.environ[fakenvml.SCENARIO_ENV] = str(path)
    try:
        for machine, late in (("idle", 0.0), ("loaded", LOADED_LATE)):
            table.add(machine, *(_cell(e) for e in _window_errors(ctx, path, duration, late)))
    finally:
        if old is None:
            os.environ.pop(fakenvml.SCENARIO_ENV, None)
        else:
            os.environ[fakenvml.SCENARIO_ENV] = old
    return table


#: A loaded machine at start-up: the first sample's read of the counter and the read that confirms it this far
#: apart on the driver's clock (a sampler descheduled between them).
CONFIRM_LAG = 0.4
SHORT = 10.0  # the start-up windows: runs of 8-10 s that start with the exporter


def _startup(ctx: Context) -> Table:
    """Every 10 s window of the first minute, with the first sample's two reads ``CONFIRM_LAG`` apart (the main
    table's windows start past the start-up reads)."""
    path = ctx.path("energy-schedule-startup.ini")
    table = Table(
        f"Start-up on a loaded machine: every {SHORT:.0f} s window of the first minute, the counter's first read and "
        f"the read confirming it {CONFIRM_LAG:g} s apart: mean |error| (worst, signed) of the exposed energy",
        ["trace", f"counter every {ENERGY_INTERVAL:g} s"],
        [f"One GPU per trace, the collector alone; the driver's clock moves {CONFIRM_LAG:g} s during each of the "
         "first sample's two reads, then one second per sample (frozen clock, exact arithmetic)."],
    )
    old = os.environ.get(fakenvml.SCENARIO_ENV)
    os.environ[fakenvml.SCENARIO_ENV] = str(path)
    try:
        for name, trace in TRACES:
            table.add(name, _cell(_startup_errors(ctx.lib, path, trace)))
    finally:
        if old is None:
            os.environ.pop(fakenvml.SCENARIO_ENV, None)
        else:
            os.environ[fakenvml.SCENARIO_ENV] = old
    return table


def _startup_errors(lib: Path, path: Path, trace: fakenvml.PowerTrace) -> list[float]:
    from gpu_energy_exporter.collectors.gpu import GPUCollector
    from gpu_energy_exporter.devices.nvml import NVMLBackend

    now = [EPOCH + 10.0]
    gpus = [fakenvml.h100(0, power=trace)]

    def write() -> fakenvml.Scenario:
        sc = fakenvml.Scenario(epoch=EPOCH, driver=fakenvml.Driver(frozen_time=now[0]), gpus=gpus)
        sc.write(path)
        return sc

    class Slow(NVMLBackend):
        """The first sample's two reads (the counter and its confirmation) each take CONFIRM_LAG."""

        slow = 2

        def read(self, gpu: Any, **kw: Any) -> Any:
            r = super().read(gpu, **kw)
            if self.slow:
                self.slow -= 1
                now[0] += CONFIRM_LAG
                write()
            return r

    sc = write()
    clock = lambda: now[0]  # noqa: E731
    c = GPUCollector(lambda: Slow(str(lib), clock=clock), retry_interval=0.0, gpm=False, interval=INTERVAL,
                     energy_interval=ENERGY_INTERVAL, clock=clock, monotonic=clock, power_interval=3600.0)
    start = now[0]
    times, values = [], []
    try:
        for k in range(int(60 / INTERVAL) + 1):
            if k:
                now[0] = start + k * INTERVAL
                write()
            values.append(_series(c).get("0", float("nan")))
            times.append(now[0])
    finally:
        c.close()
    width = int(SHORT / INTERVAL)
    return [(values[a + width] - values[a]) / sc.true_energy_j(0, times[a], times[a + width]) - 1.0
            for a in range(1, len(times) - width)]


def _window_errors(ctx: Context, path: Path, duration: float, late: float) -> list[list[float]]:
    """Errors of the exposed counter over 10 s, 60 s and 5 min windows, each sample up to ``late`` s late."""
    import random

    from gpu_energy_exporter.collectors.gpu import GPUCollector
    from gpu_energy_exporter.devices.nvml import NVMLBackend

    rng = random.Random(7)
    now = [EPOCH + 10.0]

    def write() -> fakenvml.Scenario:
        sc = fakenvml.Scenario(epoch=EPOCH, driver=fakenvml.Driver(frozen_time=now[0]),
                               gpus=[fakenvml.h100(0, power=WAVE)])
        sc.write(path)
        return sc

    sc = write()
    clock = lambda: now[0]  # noqa: E731
    c = GPUCollector(lambda: NVMLBackend(str(ctx.lib), clock=clock), retry_interval=0.0, gpm=False,
                     interval=INTERVAL, energy_interval=ENERGY_INTERVAL, clock=clock, monotonic=clock,
                     power_interval=3600.0)
    times, values = [], []
    try:
        for k in range(int(duration / INTERVAL)):
            now[0] = EPOCH + 10.0 + k * INTERVAL + (rng.uniform(0.0, late) if late else 0.0)
            write()
            value = _series(c).get("0")
            if value is not None:
                times.append(now[0])
                values.append(value)
    finally:
        c.close()
    out = []
    for width in (10.0, 60.0, 300.0):
        errors = []
        for a in range(len(times)):
            if times[a] - times[0] < ENERGY_INTERVAL:
                continue
            b = next((j for j in range(a, len(times)) if times[j] - times[a] >= width - 0.5), None)
            if b is None:
                break
            errors.append((values[b] - values[a]) / sc.true_energy_j(0, times[a], times[b]) - 1.0)
        out.append(errors)
    return out


def _cell(errors: list[float]) -> str:
    if not errors:
        return "n/a"
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    worst = max(errors, key=abs)
    return f"{pct(mean_abs, 3)} ({pct(worst, 3, signed=True)})"


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.energy_schedule"))
