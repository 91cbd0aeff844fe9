"""Energy accuracy on scripted power traces: the exporter's counter against power polling, "1 s average
power x time" and the peers, over windows of 1 s, 5 s and a whole run, against the trace's exact energy.

One fake machine runs five H100s at once, each with its own true power trace (see ``TRACES``); the fake
library reports instant power as the mean over the last 25 ms window of every 100 ms and average power as
the mean of the last ten windows, as A100/H100 drivers do, and the energy counter as the exact integral.
Everything measures the same GPUs at the same time, in one invocation:

- our exporter (its own process, default 1 s interval), read through ``/metrics`` at each window edge, as
  Prometheus would; and the same counter values placed at the time the exporter sampled them (from
  ``gpuenergy_gpu_last_sample_age_seconds``), which isolates the counter from the sampling lag;
- ``bench.nvml_poller``: the polling threads users write (instant power at 50 and 100 ms, integrated with
  the trapezoid rule; ``nvmlDeviceGetPowerUsage`` at 50 ms; the 1 s average x time);
- when the peers run: Zeus ``ZeusMonitor`` windows, CodeCarbon over the whole run, nvitop-exporter's power
  gauge scraped every second (its only power signal), each in its own venv and process.

A method's energy over [a, b] is what it knew at b minus what it knew at a; the error is against the
trace's exact energy over [a, b] (over the method's own read times for Zeus and CodeCarbon, which time
their reads themselves). Never asserts a figure; everything runs on 127.0.0.1.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import Child, free_port

from bench import harness, peer_envs
from bench.harness import Context, HTTPClient, Table, exporter, fakenvml, pct

TITLE = "Energy accuracy (design target: within 0.5% of the truth with the energy counter over windows >= 5 s)"

# A training step of tens of milliseconds: busy (forward/backward) then a short low-power gap (data
# loading, all-reduce); irregular durations, as real steps are, so they are not locked to the sensor.
BURSTY = fakenvml.Steps((
    (0.043, 650.0), (0.017, 130.0), (0.038, 680.0), (0.024, 120.0), (0.051, 640.0), (0.016, 150.0),
    (0.047, 670.0), (0.021, 125.0), (0.035, 660.0), (0.019, 140.0),
), repeat=True)


def _idle_gaps() -> fakenvml.Steps:
    steps: list[tuple[float, float]] = []
    steps += [(0.041, 660.0), (0.019, 140.0)] * 20  # 1.2 s of training steps
    steps += [(1.23, 62.0)]  # evaluation / checkpoint: idle
    steps += [(0.036, 690.0), (0.027, 150.0)] * 10  # 0.63 s of steps
    steps += [(0.87, 60.0)]  # data stall
    return fakenvml.Steps(tuple(steps), repeat=True)


@dataclass(frozen=True)
class Trace:
    key: str
    description: str
    power: fakenvml.PowerTrace
    reset: bool = False


TRACES: tuple[Trace, ...] = (
    Trace("steady", "constant 300 W", fakenvml.Constant(300.0)),
    Trace("bursty", "steps of 35-51 ms at 640-680 W with 16-24 ms gaps at 120-150 W (311 ms cycle)", BURSTY),
    Trace("locked", "50 ms steps, 30 ms at 680 W + 20 ms at 120 W, in phase with the 100 ms sensor period",
          fakenvml.Square(120.0, 680.0, 0.05, 0.6)),
    Trace("idle gaps", "1.2 s of steps, 1.23 s idle at 62 W, 0.63 s of steps, 0.87 s idle at 60 W", _idle_gaps()),
    Trace("reset", "the bursty trace, with the energy counter reset (driver reload) mid-run", BURSTY, reset=True),
)


@dataclass
class Method:
    name: str
    # window estimates: (length label, t0, t1, gpu) -> (estimate J, truth interval)
    windows: dict[str, list[tuple[int, float, float, float]]] = field(default_factory=dict)
    note: str = ""


@dataclass
class Cumulative:
    """A method's cumulative energy per GPU as known at each time: times ascending."""

    times: list[float]
    values: list[list[float]]  # values[k][gpu]
    tolerance: float = 0.0  # readings taken up to this long after x still count as "at x" (scrapes)

    def at(self, x: float, gpu: int) -> float | None:
        k = bisect.bisect_right(self.times, x + self.tolerance) - 1
        return None if k < 0 else self.values[k][gpu]


def integrate(polls: Sequence[tuple[float, Sequence[float]]], rule: str, scale: float = 1e-3) -> Cumulative:
    """Cumulative joules from power polls (mW by default): trapezoid, or right rectangle (a 1 s average
    read at t covers the second before t)."""
    times: list[float] = []
    values: list[list[float]] = []
    acc: list[float] | None = None
    prev: tuple[float, Sequence[float]] | None = None
    for t, mw in polls:
        w = [v * scale for v in mw]
        if prev is None:
            acc = [0.0] * len(w)
        else:
            assert acc is not None
            dt = t - prev[0]
            for i, p in enumerate(w):
                acc[i] += (0.5 * (p + prev[1][i]) if rule == "trapezoid" else p) * dt
        prev = (t, w)
        times.append(t)
        values.append(list(acc or []))
    return Cumulative(times, values)


def run(ctx: Context) -> list[Table]:
    duration = ctx.pick(6, 60)
    n = len(TRACES)
    stub = _nvidia_smi_stub(ctx)
    lib_dir = str(ctx.lib.parent)
    peers: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    if ctx.peers:
        for name in ("zeus", "codecarbon", "nvitop-exporter"):
            try:
                peers[name] = peer_envs.python_for(name)
            except peer_envs.PeerUnavailable as exc:
                unavailable[name] = str(exc)
    setup = 12.0 if "codecarbon" in peers else 2.0
    epoch = time.time()
    a0 = float(int(epoch + setup)) + 0.5  # not on a whole second: the sampler's phase is not special
    a1 = a0 + duration
    gpus = []
    for i, tr in enumerate(TRACES):
        reset = ((a0 - epoch) + 0.45 * duration + 0.37,) if tr.reset else ()
        gpus.append(fakenvml.h100(i, power=tr.power, energy_reset_at_s=reset, util_gpu_pct=90))
    path = ctx.path("accuracy.ini")
    sc = harness.write_scenario(path, gpus, epoch=epoch)
    env = {fakenvml.SCENARIO_ENV: str(path), "LD_LIBRARY_PATH": lib_dir}
    children: list[Child] = []
    results: dict[str, Any] = {}
    try:
        exp = exporter(ctx, scenario=path)
        children.append(exp)
        exp.wait_ready()
        poll_out = ctx.path("polls.json")
        poller = Child([sys.executable, "-m", "bench.nvml_poller", "--gpus", str(n), "--start", repr(a0),
                                "--end", repr(a1), "--out", str(poll_out)], env=env, name="poller")
        children.append(poller)
        finite = [poller]  # the children that end by themselves after a1
        nvitop_url = None
        if "nvitop-exporter" in peers:
            port = free_port()
            children.append(Child([str(Path(peers["nvitop-exporter"]).with_name("nvitop-exporter")),
                                           "--bind-address", "127.0.0.1", "--port", str(port)], env=env,
                                          name="nvitop-exporter"))
            nvitop_url = f"http://127.0.0.1:{port}/metrics"
        zeus = cc_children = None
        if "zeus" in peers:
            zeus = Child([str(peers["zeus"]), str(peer_envs.SCRIPTS / "zeus_probe.py"), "windows",
                                  "--gpus", str(n), "--start", repr(a0), "--end", repr(a1)], env=env, name="zeus")
            children.append(zeus)
            finite.append(zeus)
        if "codecarbon" in peers:
            cc_env = {**env, "PATH": f"{stub}{os.pathsep}{os.environ.get('PATH', '')}"}
            cc_children = [Child([str(peers["codecarbon"]), str(peer_envs.SCRIPTS / "codecarbon_probe.py"),
                                          "--gpu", str(i), "--start", repr(a0), "--end", repr(a1)], env=cc_env,
                                         name=f"codecarbon{i}") for i in range(n)]
            children += cc_children
            finite += cc_children
        scrapes = _scrape_edges(exp.scrape_url, nvitop_url, a0, a1, n)
        for c in finite:
            c.proc.wait(timeout=max(30.0, a1 + 20 - time.time()))
        results["polls"] = json.loads(poll_out.read_text())
        if zeus is not None:
            results["zeus"] = _result(zeus)
        if cc_children is not None:
            results["codecarbon"] = [_result(c) for c in cc_children]
    finally:
        for c in reversed(children):
            c.stop()
    return _tables(ctx, sc, a0, a1, scrapes, results, unavailable)


def _result(child: Child) -> dict[str, Any]:
    for line in reversed(child.lines):
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{child.name} gave no result:\n{child.log()}")


def _nvidia_smi_stub(ctx: Context) -> Path:
    """CodeCarbon only looks for NVIDIA GPUs when an ``nvidia-smi`` runs: give it one that exits 0."""
    d = ctx.path("stub-bin")
    d.mkdir(exist_ok=True)
    stub = d / "nvidia-smi"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    return d


@dataclass
class Scrapes:
    ours: list[tuple[float, list[float], list[float]]] = field(default_factory=list)  # t, joules, ages
    nvitop: list[tuple[float, list[float]]] = field(default_factory=list)  # t, watts

    def as_prometheus_reads(self, n: int) -> list[tuple[float, list[float], list[float]]]:
        """``ours`` as ``increase()`` reads it: a value below the previous one is a counter reset (the
        driver's counter restarted: the exporter exposes it as it is), so the previous value is added from
        there on; a scrape without the sample (a reading held back, an unconfirmed reset) stays NaN."""
        out: list[tuple[float, list[float], list[float]]] = []
        offset, last = [0.0] * n, [float("nan")] * n
        for t, joules, ages in self.ours:
            adjusted = []
            for i in range(n):
                v = joules[i]
                if v != v:  # NaN: no sample in this scrape
                    adjusted.append(v)
                    continue
                if last[i] == last[i] and v < last[i]:
                    offset[i] += last[i]
                last[i] = v
                adjusted.append(v + offset[i])
            out.append((t, adjusted, ages))
        return out


def _scrape_edges(url: str, nvitop_url: str | None, a0: float, a1: float, n: int) -> Scrapes:
    """Scrape ours every 100 ms (every possible window edge, see ``OFFSETS``) and nvitop-exporter every
    second, from 1 s before a0 to a1, as Prometheus would at the window edges."""
    out = Scrapes()
    ours = HTTPClient(url)
    nv = HTTPClient(nvitop_url) if nvitop_url else None
    k = -10
    while True:
        tick = a0 + 0.1 * k
        if tick > a1 + 0.01:
            break
        delay = tick - time.time()
        if delay > 0:
            time.sleep(delay)
        t0 = time.time()
        _, body, _ = ours.get()
        t = (t0 + time.time()) / 2
        text = body.decode()
        joules = harness.sample_values(text, "gpuenergy_gpu_energy_joules_total")
        ages = harness.sample_values(text, "gpuenergy_gpu_last_sample_age_seconds")
        out.ours.append((t, [joules.get(str(i), float("nan")) for i in range(n)],
                         [ages.get(str(i), float("nan")) for i in range(n)]))
        if nv is not None and k % 10 == 0:
            try:
                t0 = time.time()
                _, body, _ = nv.get()
                watts = _nvitop_power(body.decode())
                if len(watts) >= n:
                    out.nvitop.append(((t0 + time.time()) / 2, [watts[i] for i in range(n)]))
            except OSError:
                pass  # not up yet
        k += 1
    ours.close()
    if nv is not None:
        nv.close()
    return out


def _nvitop_power(text: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("gpu_power_usage_W{"):
            import re

            m = re.search(r'index="(\d+)"', line)
            if m:
                out[int(m.group(1))] = float(line.rsplit(" ", 1)[1])
    return out


# ----------------------------------------------------------------------------------------------------
# analysis

LENGTHS = (1, 5)
#: Window sets start at these offsets from a0: the exporter samples on its own 1 s schedule and a reader
#: (Prometheus, a dashboard) has an arbitrary phase against it, so every phase 0.1 s apart is evaluated.
OFFSETS = tuple(k / 10 for k in range(10))


def _windows(a0: float, a1: float) -> dict[str, list[tuple[float, float]]]:
    """Windows of each length tiling [a0 + o, a1 - 1 + o] for every offset o, and that whole span."""
    out: dict[str, list[tuple[float, float]]] = {f"{length} s": [] for length in LENGTHS}
    out["run"] = []
    span = (a1 - a0) - 1.0
    for o in OFFSETS:
        start = a0 + o
        for length in LENGTHS:
            out[f"{length} s"] += [(start + k * length, start + (k + 1) * length)
                                   for k in range(int(span / length + 1e-9))]
        out["run"].append((start, start + span))
    return out


def _errors_from_cumulative(cum: Cumulative, sc: fakenvml.Scenario, a0: float, a1: float,
                            n: int) -> dict[str, list[list[float]]]:
    """{window label: [gpu][window] relative error}."""
    out: dict[str, list[list[float]]] = {}
    for label, wins in _windows(a0, a1).items():
        per_gpu: list[list[float]] = [[] for _ in range(n)]
        for a, b in wins:
            for i in range(n):
                ea, eb = cum.at(a, i), cum.at(b, i)
                truth = sc.true_energy_j(i, a, b)
                if ea is None or eb is None or truth <= 0:
                    continue
                per_gpu[i].append((eb - ea) / truth - 1.0)
        out[label] = per_gpu
    return out


def _errors_aligned(scrapes: Scrapes, sc: fakenvml.Scenario, a0: float, a1: float,
                    n: int) -> dict[str, list[list[float]]]:
    """The exporter's counter values at the time it sampled them (scrape time minus sample age)."""
    reads = scrapes.as_prometheus_reads(n)
    times = [t for t, _, _ in reads]
    out: dict[str, list[list[float]]] = {}

    def nearest(x: float) -> int:
        k = bisect.bisect_left(times, x)
        cands = [j for j in (k - 1, k) if 0 <= j < len(times)]
        return min(cands, key=lambda j: abs(times[j] - x))

    for label, wins in _windows(a0, a1).items():
        per_gpu: list[list[float]] = [[] for _ in range(n)]
        for a, b in wins:
            ka, kb = nearest(a), nearest(b)
            for i in range(n):
                ea, eb = reads[ka][1][i], reads[kb][1][i]
                if ea != ea or eb != eb:
                    continue  # no sample at that edge (a reading held back)
                ta = reads[ka][0] - reads[ka][2][i]
                tb = reads[kb][0] - reads[kb][2][i]
                truth = sc.true_energy_j(i, ta, tb)
                if truth > 0:
                    per_gpu[i].append((eb - ea) / truth - 1.0)
        out[label] = per_gpu
    return out


def _errors_zeus(result: dict[str, Any], sc: fakenvml.Scenario, n: int) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    for w in result["windows"]:
        label = "run" if w["key"] == "run" else f"{w['length']} s"
        per_gpu = out.setdefault(label, [[] for _ in range(n)])
        for i in range(n):
            truth = sc.true_energy_j(i, w["t0"], w["t1"])
            if truth > 0:
                per_gpu[i].append(w["energy_j"][i] / truth - 1.0)
    return out


def _errors_codecarbon(results: list[dict[str, Any]], sc: fakenvml.Scenario, n: int) -> dict[str, list[list[float]]]:
    per_gpu: list[list[float]] = [[] for _ in range(n)]
    for i, r in enumerate(results):
        truth = sc.true_energy_j(i, r["first_read"], r["last_read"])
        if truth > 0:
            per_gpu[i].append(r["energy_j"] / truth - 1.0)
    return {"run": per_gpu}


def _cell(errors: list[float], signed: bool = False) -> str:
    if not errors:
        return "n/a"
    if signed:
        mean = pct(sum(errors) / len(errors), 2, True)
        return mean if len(errors) == 1 else f"{mean} ({pct(max(errors, key=abs), 2, True)})"
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    worst = max(errors, key=abs)
    return f"{pct(mean_abs)} ({pct(worst, 1, signed=True)})"


def _tables(ctx: Context, sc: fakenvml.Scenario, a0: float, a1: float, scrapes: Scrapes,
            results: dict[str, Any], unavailable: dict[str, str]) -> list[Table]:
    n = len(TRACES)
    polls = results["polls"]
    methods: list[tuple[str, dict[str, list[list[float]]]]] = []
    reads = scrapes.as_prometheus_reads(n)
    carried: list[list[float]] = []  # a scrape without the sample: the last one Prometheus has
    for _, j, _ in reads:
        carried.append([v if v == v or not carried else carried[-1][i] for i, v in enumerate(j)])
    ours = Cumulative([t for t, _, _ in reads], carried, tolerance=0.05)
    methods.append(("gpu-energy-exporter counter, read via /metrics at the window edges",
                    _errors_from_cumulative(ours, sc, a0, a1, n)))
    methods.append(("gpu-energy-exporter counter, at its sample times", _errors_aligned(scrapes, sc, a0, a1, n)))
    for key, label, rule in (
        ("instant_50ms", "instant power every 50 ms, trapezoid", "trapezoid"),
        ("instant_100ms", "instant power every 100 ms, trapezoid", "trapezoid"),
        ("usage_50ms", "nvmlDeviceGetPowerUsage (1 s average) every 50 ms, trapezoid", "trapezoid"),
        ("usage_1s", "1 s average power x time (read every 1 s)", "rectangle"),
    ):
        pts = [(t, v) for t, v in polls[key]]
        methods.append((label, _errors_from_cumulative(integrate(pts, rule), sc, a0, a1, n)))
    if "zeus" in results:
        methods.append((f"Zeus {results['zeus'].get('version', '')} ZeusMonitor windows (energy counter)",
                        _errors_zeus(results["zeus"], sc, n)))
    if "codecarbon" in results:
        methods.append((f"CodeCarbon {results['codecarbon'][0].get('version', '')} (whole run only)",
                        _errors_codecarbon(results["codecarbon"], sc, n)))
    if scrapes.nvitop:
        cum = integrate([(t, w) for t, w in scrapes.nvitop], "rectangle", scale=1.0)
        cum.tolerance = 0.05
        methods.append(("nvitop-exporter power gauge x 1 s scrapes", _errors_from_cumulative(cum, sc, a0, a1, n)))

    cols = ["method", *[t.key for t in TRACES]]
    tables = []
    for label, title in (("5 s", "5 s windows"), ("1 s", "1 s windows")):
        t = Table(f"Energy error over {title}: mean |error| (worst window, signed)", cols)
        for name, errs in methods:
            t.add(name, *[_cell(errs.get(label, [[]] * n)[i]) for i in range(n)])
        tables.append(t)
    run_t = Table(f"Energy error over the whole run ({a1 - a0 - 1:.0f} s; signed mean over the phases, worst "
                  "phase in brackets)", cols)
    for name, errs in methods:
        run_t.add(name, *[_cell(errs.get("run", [[]] * n)[i], signed=True) for i in range(n)])
    tables.append(run_t)

    legend = Table("Traces (one fake H100 each, all measured at once) and what the power sensor reports",
                   ["trace", "true mean W", "mean instant reading W", "mean 1 s average reading W"])
    inst = polls["instant_50ms"]
    avg = polls["usage_50ms"]
    for i, tr in enumerate(TRACES):
        true_mean = sc.true_energy_j(i, a0, a1) / (a1 - a0)
        mi = [v[i] / 1000 for t, v in inst if a0 <= t <= a1]
        ma = [v[i] / 1000 for t, v in avg if a0 <= t <= a1]
        legend.add(f"{tr.key}: {tr.description}", f"{true_mean:.1f}", f"{sum(mi) / len(mi):.1f}",
                   f"{sum(ma) / len(ma):.1f}")
    notes = [
        f"Run: {a1 - a0:.0f} s. Windows of 1 s and 5 s tile {a1 - a0 - 1:.0f} s of it, starting at 10 phases "
        "0.1 s apart (a reader's phase against the exporter's 1 s sampler is arbitrary); 'mean' is over every "
        "window of every phase. Zeus and CodeCarbon measure their own windows (Zeus: aligned to whole "
        "seconds from the run's start; CodeCarbon: the run).",
        "'read via /metrics': the counter value served at each edge, as a Prometheus scrape there would get "
        "it; it was sampled up to 1 s earlier. 'at its sample times': the same values placed at the time "
        "they were sampled (scrape time minus gpuenergy_gpu_last_sample_age_seconds). The difference between "
        "the two rows is only that placement.",
        "Both rows read the counter as increase() does: a drop is a counter reset (the exporter exposes the "
        "driver's counter as it is, so a driver reload shows as one) and a scrape without the sample (a "
        "reading held back, a reset awaiting confirmation) leaves the previous sample in force. Across a "
        "reset the part of the interval before it is covered by no reading.",
        "The fake energy counter is exact at every read; a real driver's counter advances in discrete "
        "updates, which matters only for windows much shorter than 1 s (Zeus's per-step windows), not here.",
    ]
    for name, why in unavailable.items():
        notes.append(f"{name} not measured: {why}")
    if "codecarbon" in results:
        cc = results["codecarbon"][0]
        notes.append(f"CodeCarbon's start() took {cc['start_call_s']:.1f} s (hardware detection) and it read the "
                     f"counter {cc['reads']} times in the run (measure_power_secs=15, its default).")
    tables[0].notes += notes
    verdict = Table(
        "Against the target: the exporter's counter over 5 s windows within 0.5%",
        ["trace", "at sample times: mean", "at sample times: worst", "via /metrics: mean", "via /metrics: worst",
         "verdict"],
        ["'at sample times' is the counter itself; 'via /metrics' adds the reader's phase against the 1 s "
         "sampler (see the notes under the 5 s table)."],
    )
    via, aligned = methods[0][1], methods[1][1]

    def stats(errs: list[float]) -> tuple[float, float]:
        if not errs:
            return float("nan"), float("nan")
        return sum(abs(e) for e in errs) / len(errs), max(abs(e) for e in errs)

    for i, tr in enumerate(TRACES):
        am, aw = stats(aligned["5 s"][i])
        vm, vw = stats(via["5 s"][i])
        parts = []
        for label, worst in (("counter", aw), ("via /metrics", vw)):
            parts.append(f"{label} met" if worst <= 0.005 else
                         f"{label} missed by {(worst - 0.005) * 100:.2f} points ({worst / 0.005:.0f}x)")
        verdict.add(tr.key, pct(am), pct(aw), pct(vm), pct(vw), "; ".join(parts))
    return [legend, *tables, verdict]


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.accuracy"))
