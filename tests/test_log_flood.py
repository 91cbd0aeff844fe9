"""Logs under a flood (issue 29): repeated lines are rate-limited with a count of what was left out
(``core.ratelog``), and a GPU reporting an Xid on every driver wait costs a bounded share of a core and a few
log lines, in the real exporter on the fake NVML library (``event_flood``), while every event it reads is
still counted."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fakenvml import Scenario, h100
from fakenvml.health import HEALTHY_H100, xid
from helpers import ExporterProcess, sample_value, wait_until

from gpu_energy_exporter.core.ratelog import RateLimitedLog


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_key_writes_its_burst_then_counts_and_says_how_many_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    rl = RateLimitedLog(logging.getLogger("t.ratelog"), period_s=60.0, burst=2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.ratelog"):
        written = [rl.warning("xid13", "GPU %d reported Xid %d", 0, 13) for _ in range(1000)]
        assert written[:2] == [True, True] and not any(written[2:])
        assert rl.warning("xid79", "GPU %d reported Xid %d", 0, 79)  # another key is never hidden by the flood
        clock.now += 60.0
        assert rl.warning("xid13", "GPU %d reported Xid %d", 0, 13)
    assert _lines(caplog) == ["GPU 0 reported Xid 13", "GPU 0 reported Xid 13", "GPU 0 reported Xid 79",
                              "GPU 0 reported Xid 13 (998 more like this in the last 60s, not logged)"]
    assert rl.left_out_total == 998


def test_flush_reports_a_flood_that_stopped_and_forgotten_keys_report_theirs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    rl = RateLimitedLog(logging.getLogger("t.ratelog2"), period_s=10.0, max_keys=2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.ratelog2"):
        for _ in range(5):
            rl.warning("a", "line a")
        rl.flush()  # the period is not over: nothing yet
        clock.now += 10.0
        rl.flush()
        rl.flush()  # said once
        for _ in range(3):
            rl.warning("b", "line b")
        rl.warning("c", "line c")
        rl.warning("d", "line d")  # three keys in a table of two: "b" (written longest ago) is forgotten
    assert _lines(caplog) == [
        "line a", "4 more line(s) like 'line a' in the last 10s, not logged (rate-limited)",
        "line b", "line c", "2 more line(s) like 'line b' in the last 10s, not logged (rate-limited)", "line d"]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_xid_on_every_driver_wait_costs_a_few_lines_and_a_bounded_share_of_a_core(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path,
) -> None:
    """Before: 2.2 million log lines (315 MB) in 40 s and 0.94 CPU-s a second. Now the event thread reads at most
    MAX_EVENTS_PER_S events a second and logs each GPU's Xid code XID_LOG_BURST times a minute."""
    from gpu_energy_exporter.devices.nvml_events import MAX_EVENTS_PER_S, XID_LOG_BURST

    gpu = h100(0, health=replace(HEALTHY_H100, flood=xid(0.0, 13)))
    path = tmp_path / "scenario.ini"
    Scenario(epoch=time.time(), gpus=[gpu]).write(path)
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms"],
                         {"FAKE_NVML_SCENARIO": str(path)}).wait_ready()
    first = wait_until(lambda: sample_value(exp.metrics(), "gpuenergy_gpu_xid_errors_total", gpu="0", xid="13"),
                       timeout=30, what="the flood's Xids counted")
    cpu0, t0 = _cpu_s(exp.pid), time.monotonic()
    time.sleep(5.0)
    cpu1, t1 = _cpu_s(exp.pid), time.monotonic()
    counted = sample_value(exp.metrics(), "gpuenergy_gpu_xid_errors_total", gpu="0", xid="13")
    log = exp.log()
    assert exp.stop() == 0
    share = (cpu1 - cpu0) / (t1 - t0)
    # the whole exporter (sampler, scrapes, the event thread at MAX_EVENTS_PER_S): before, 0.94 for the flood alone
    assert share < 0.25, f"{share:.2f} CPU-s a second"
    assert counted is not None and first is not None and counted > first  # the events are still counted
    assert counted - first <= MAX_EVENTS_PER_S * (t1 - t0 + 2)  # read at most MAX_EVENTS_PER_S a second
    xid_lines = [line for line in log.splitlines() if "reported Xid 13" in line]
    assert 1 <= len(xid_lines) <= XID_LOG_BURST, len(xid_lines)
    assert sum(1 for line in log.splitlines() if "more than" in line and "NVML events" in line) == 1
    assert len(log) < 64 * 1024, f"{len(log)} bytes of log"
