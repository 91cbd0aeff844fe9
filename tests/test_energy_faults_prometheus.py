"""What Prometheus computes from the exposed energy counter, against the true integral, under counter faults.

The production NVML path (devices.nvml + collectors.gpu) runs in-process against the fake library with a
frozen clock that the test advances one sample interval at a time, so twelve minutes of a fake machine take
seconds and every fault lands on exactly the reads it is meant to. Each GPU has its own fault (issue 10):

- ``low``: one reading of 0 (a driver glitch);
- ``jump``: one reading 500 MJ above the truth;
- ``outage``: a driver reload (counter reset) followed by two minutes in which the counter cannot be read;
- ``restart``: a driver reload, and later the exporter restarts (all GPUs see the restart, 20 s down).

After each sample the exposition is "scraped" half an interval later, as Prometheus would: samples get the
scrape time unless the exposition carries an explicit timestamp. The scraped samples are turned into TSDB
blocks with ``promtool tsdb create-blocks-from openmetrics`` and a real Prometheus answers
``increase(gpuenergy_gpu_energy_joules_total[5m])`` every 5 s. Each answer is compared with the exact
energy of the trace over the window: never above it by more than one interval of peak power, and within 1%
for every window whose two ends have data (a window starting or ending while the exporter is down or the
counter unreadable cannot see the energy on its side of the gap; a reset costs the part of one interval
before it, which no reading covers).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakenvml import GPU, Driver, Scenario, Square, bad_reading, energy_jump, energy_unreadable, h100
from helpers import require_binary
from prom import Prometheus
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.devices.nvml import NVMLBackend
from gpu_energy_exporter.engine.exposition import SnapshotCollector, new_registry
from gpu_energy_exporter.engine.sampler import Sampler

INTERVAL = 1.0  # collector interval, s; scrapes follow each sample by half of it
DURATION = 720  # simulated seconds
WINDOW = 300  # the 5-minute windows
RESTART = (420, 440)  # exporter down from, back at (s since the epoch)
TRACE = Square(150.0, 650.0, 0.31, 0.55)  # bursty training steps; peak 650 W
OFFSET_MJ = 4e11  # 400 MJ (111 kWh) on the counter since the driver loaded
FAMILIES = ("gpuenergy_gpu_energy_joules", "gpuenergy_gpu_energy_resets", "gpuenergy_gpu_energy_rejected_readings")

OUTAGE = (250.0, 370.0)


def gpus() -> list[GPU]:
    return [
        h100(0, power=TRACE, energy_offset_mj=OFFSET_MJ, energy_faults=(bad_reading(200.0),)),
        h100(1, power=TRACE, energy_offset_mj=OFFSET_MJ, energy_faults=(energy_jump(300.0, 5e11),)),
        h100(2, power=TRACE, energy_offset_mj=OFFSET_MJ, energy_reset_at_s=(OUTAGE[0] - 0.4,),
             energy_faults=(energy_unreadable(*OUTAGE),)),
        h100(3, power=TRACE, energy_offset_mj=OFFSET_MJ, energy_reset_at_s=(150.6,)),
    ]


NAMES = ("low", "jump", "outage", "restart")


@dataclass
class Recorded:
    epoch: float
    scenario: Scenario
    #: (family, labels) -> [(timestamp s, value)] as Prometheus would store them
    series: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]]


class FakeMachine:
    """The GPU collector on the fake library, on a clock the test moves."""

    def __init__(self, lib: Path, path: Path, scenario: Scenario) -> None:
        self.lib, self.path, self.scenario = lib, path, scenario
        self.now = scenario.epoch
        self._start()

    def clock(self) -> float:
        return self.now

    def _start(self) -> None:
        self.collector = GPUCollector(lambda: NVMLBackend(str(self.lib), clock=self.clock), retry_interval=0.0,
                                      gpm=False, clock=self.clock, monotonic=self.clock, interval=INTERVAL)
        self.sampler = Sampler([self.collector], INTERVAL, gpu_states=self.collector.states, clock=self.clock)
        self.registry = new_registry(SnapshotCollector(self.sampler, clock=self.clock))

    def restart(self) -> None:
        self.collector.close()
        self._start()

    def sample(self, t: float) -> None:
        self.now = t
        Scenario(epoch=self.scenario.epoch, driver=Driver(frozen_time=t), gpus=self.scenario.gpus).write(self.path)
        self.sampler.sample_once()

    def scrape(self, t: float) -> Iterator[tuple[str, dict[str, str], float, float]]:
        self.now = t
        text = generate_latest(self.registry).decode()
        for fam in text_string_to_metric_families(text):
            if fam.name in FAMILIES:
                for s in fam.samples:
                    yield fam.name, s.labels, s.value, t if s.timestamp is None else float(s.timestamp)

    def close(self) -> None:
        self.collector.close()


def record(lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Recorded:
    epoch = float(int(time.time() - 3 * 3600))  # recent enough for the default retention
    scenario = Scenario(epoch=epoch, driver=Driver(frozen_time=epoch), gpus=gpus())
    path = tmp_path / "scenario.ini"
    scenario.write(path)
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    machine = FakeMachine(lib, path, scenario)
    series: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = {}
    try:
        for k in range(DURATION):
            if RESTART[0] <= k < RESTART[1]:
                if k == RESTART[0]:
                    machine.close()
                continue
            if k == RESTART[1]:
                machine.restart()
            machine.sample(epoch + k * INTERVAL)
            for name, labels, value, ts in machine.scrape(epoch + (k + 0.5) * INTERVAL):
                points = series.setdefault((name, tuple(sorted(labels.items()))), [])
                if points and ts <= points[-1][0]:
                    continue  # Prometheus drops a sample not newer than the last one of its series
                points.append((ts, value))
    finally:
        machine.close()
    return Recorded(epoch, scenario, series)


def write_openmetrics(rec: Recorded, path: Path) -> None:
    lines = []
    for family in FAMILIES:
        lines.append(f"# TYPE {family} counter")
        for (name, labels), points in sorted(rec.series.items()):
            if name != family:
                continue
            label_text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines += [f"{family}_total{{{label_text}}} {v!r} {ts:.3f}" for ts, v in points]
    lines.append("# EOF")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def answers(fake_nvml_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Recorded, Callable]]:  # type: ignore[type-arg]
    promtool = require_binary("promtool")
    require_binary("prometheus")
    tmp = tmp_path_factory.mktemp("energy-faults")
    with pytest.MonkeyPatch.context() as mp:
        rec = record(fake_nvml_lib, tmp, mp)
    om = tmp / "samples.om"
    write_openmetrics(rec, om)
    workdir = tmp / "prom"
    (workdir / "data").mkdir(parents=True)
    done = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(workdir / "data")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    prom = Prometheus(workdir, targets=[])

    def query_range(expr: str, start: float, end: float, step: float) -> dict[str, list[tuple[float, float]]]:
        """{gpu label: [(t, value)]}"""
        url = prom.url + "/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": expr, "start": repr(start), "end": repr(end), "step": repr(step)})
        with urllib.request.urlopen(url, timeout=30) as r:
            doc = json.load(r)
        assert doc["status"] == "success", doc
        return {m["metric"].get("gpu", ""): [(float(t), float(v)) for t, v in m["values"]]
                for m in doc["data"]["result"]}

    try:
        yield rec, query_range
    finally:
        prom.stop()


def windows(rec: Recorded, query_range: Callable) -> dict[str, list[tuple[float, float, float]]]:  # type: ignore[type-arg]
    """{scenario name: [(window end s since epoch, Prometheus' increase, true energy)]}"""
    start, end = rec.epoch + WINDOW + 10, rec.epoch + DURATION
    got = query_range(f"increase(gpuenergy_gpu_energy_joules_total[{WINDOW}s])", start, end, 5.0)
    out = {}
    for i, name in enumerate(NAMES):
        points = got.get(str(i), [])
        assert len(points) > 60, f"{name}: Prometheus returned {len(points)} windows"
        out[name] = [(t - rec.epoch, v, rec.scenario.true_energy_j(i, t - WINDOW, t)) for t, v in points]
    return out


def peak_interval_j() -> float:
    return TRACE.high_w * INTERVAL


@pytest.mark.parametrize("name", NAMES)
def test_prometheus_increase_never_exceeds_the_truth_by_more_than_one_interval(answers, name: str) -> None:  # type: ignore[no-untyped-def]
    rec, query_range = answers
    over = [(round(t), v - truth) for t, v, truth in windows(rec, query_range)[name]]
    worst = max(over, key=lambda x: x[1])
    assert worst[1] <= peak_interval_j(), f"{name}: increase() above the truth by {worst[1]:.0f} J at t={worst[0]} s"


@pytest.mark.parametrize("name", NAMES)
def test_prometheus_increase_is_within_one_percent_of_the_truth_where_the_counter_was_readable(  # type: ignore[no-untyped-def]
        answers, name: str) -> None:
    rec, query_range = answers
    gaps = [(RESTART[0] - INTERVAL, RESTART[1] + INTERVAL)]  # the exporter is down: no samples at all
    if name == "outage":
        gaps.append((OUTAGE[0] - INTERVAL, OUTAGE[1] + 2 * INTERVAL))  # unreadable, then the reset confirmed
    errors = []
    for t, v, truth in windows(rec, query_range)[name]:
        if any(a <= edge <= b for a, b in gaps for edge in (t - WINDOW, t)):
            continue  # Prometheus has no sample on that side of the gap: the window cannot be complete
        errors.append((round(t), v / truth - 1.0))
    assert len(errors) >= 30
    worst = max(errors, key=lambda e: abs(e[1]))
    assert abs(worst[1]) <= 0.01, f"{name}: {worst[1]:+.2%} at t={worst[0]} s"


def test_faults_are_counted_and_resets_confirmed(answers) -> None:  # type: ignore[no-untyped-def]
    rec, query_range = answers
    t = rec.epoch + RESTART[0] - 5  # before the restart resets the exporter's own counters

    def at(expr: str) -> dict[str, float]:
        return {gpu: points[-1][1] for gpu, points in query_range(expr, t, t, 1.0).items()}

    assert at('gpuenergy_gpu_energy_rejected_readings_total{reason="decrease"}') == {
        "0": 1.0, "1": 0.0, "2": 0.0, "3": 0.0}
    assert at('gpuenergy_gpu_energy_rejected_readings_total{reason="jump"}') == {"0": 0.0, "1": 1.0, "2": 0.0, "3": 0.0}
    assert at("gpuenergy_gpu_energy_resets_total") == {"0": 0.0, "1": 0.0, "2": 1.0, "3": 1.0}
    # Prometheus sees each driver reset as a counter reset, and nothing else as one
    whole = rec.epoch + DURATION
    resets = {gpu: points[-1][1] for gpu, points in
              query_range(f"resets(gpuenergy_gpu_energy_joules_total[{DURATION}s])", whole, whole, 1.0).items()}
    assert resets == {"0": 0.0, "1": 0.0, "2": 1.0, "3": 1.0}
    assert not math.isnan(sum(resets.values()))
