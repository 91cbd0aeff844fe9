"""GPU health on the served /metrics of the real exporter process, on the fake NVML library: scripted Xid
and ECC events, ECC and row-remap counts, retired pages, PCIe and NVLink; an old driver without these
functions loses nothing else; the health reads keep to their own cadence and their call budget."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from fakenvml import Constant, Driver, Scenario, build_library, h100, v100
from fakenvml.health import HEALTHY_H100, NVLink, PCIe, ecc_event, xid
from helpers import ExporterProcess, sample_value, samples, wait_until

REPO = Path(__file__).resolve().parents[1]
FAST = ["--collector.interval=200ms"]

#: Every health function the exporter calls (an old driver lacks them all).
HEALTH_FUNCTIONS = (
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetSupportedEventTypes", "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetWait", "nvmlEventSetFree",
)


def _write(tmp_path: Path, sc: Scenario) -> dict[str, str]:
    path = tmp_path / "scenario.ini"
    sc.write(path)
    return {"FAKE_NVML_SCENARIO": str(path)}


def _sick_h100() -> object:
    """GPU 0: an H100 with errors everywhere, hand-picked values (each checked below)."""
    links = [NVLink() for _ in range(4)]
    links[1] = NVLink(up=True, replay=7, recovery=2, crc_flit=11, crc_data=3, tx_kib=1000, rx_kib=2000)
    links[3] = NVLink(up=False)
    health = replace(
        HEALTHY_H100,
        ecc=(5, 1, 120, 2), remapped_rows=(3, 1, 1, 0),
        pcie=PCIe(replays=42, tx_kb_per_s=2000, rx_kb_per_s=500, gen=4, max_gen=5, width=8, max_width=16),
        nvlinks=tuple(links),
        events=(xid(0.0, 13), xid(0.5, 79), xid(1.0, 79), ecc_event(1.0, double_bit=True)),
    )
    return h100(0, power=Constant(300.0), health=health)


def test_health_readings_and_scripted_xids_on_served_metrics(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    sick = _sick_h100()
    healthy = h100(1, health=HEALTHY_H100)
    pre_ampere = v100(2, health=replace(HEALTHY_H100, remapped_rows=None, retired_pages=(4, 1, 1), nvlinks=(),
                                        event_types=None))
    env = _write(tmp_path, Scenario(epoch=time.time() - 10, gpus=[sick, healthy, pre_ampere]))
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST], env).wait_ready()

    def served() -> str | None:
        text = exp.metrics()
        return text if sample_value(text, "gpuenergy_gpu_xid_errors_total", gpu="0", xid="79") == 2.0 else None

    text = wait_until(served, timeout=30, what="the two scripted Xid 79 never showed")
    v = lambda name, **labels: sample_value(text, name, **labels)  # noqa: E731
    u0 = sick.uuid
    # Xid events: counted per code; the critical codes start at 0 on a watched GPU; the last one kept
    assert v("gpuenergy_gpu_xid_errors_total", gpu="0", gpu_uuid=u0, xid="13") == 1.0
    assert v("gpuenergy_gpu_xid_errors_total", gpu="0", xid="48") == 0.0
    assert v("gpuenergy_gpu_xid_errors_total", gpu="1", xid="79") == 0.0
    assert v("gpuenergy_gpu_last_xid", gpu="0") == 79.0
    assert abs(v("gpuenergy_gpu_last_xid_timestamp_seconds", gpu="0") - time.time()) < 60
    assert v("gpuenergy_gpu_last_xid", gpu="1") is None
    assert v("gpuenergy_gpu_ecc_events_total", gpu="0", type="double_bit") == 1.0
    assert v("gpuenergy_gpu_ecc_events_total", gpu="0", type="single_bit") == 0.0
    assert v("gpuenergy_gpu_xid_events_watched", gpu="0") == 1.0
    assert v("gpuenergy_gpu_xid_events_watched", gpu="2") == 0.0  # vGPU-like: no events, no error
    assert v("gpuenergy_gpu_xid_errors_total", gpu="2", xid="79") is None
    # ECC: corrected / uncorrected, volatile / aggregate
    assert v("gpuenergy_gpu_ecc_errors_total", gpu="0", error_type="corrected", counter="volatile") == 5.0
    assert v("gpuenergy_gpu_ecc_errors_total", gpu="0", error_type="uncorrected", counter="volatile") == 1.0
    assert v("gpuenergy_gpu_ecc_errors_total", gpu="0", error_type="corrected", counter="aggregate") == 120.0
    assert v("gpuenergy_gpu_ecc_errors_total", gpu="0", error_type="uncorrected", counter="aggregate") == 2.0
    # row remapping (Ampere+), retired pages (before)
    assert v("gpuenergy_gpu_remapped_rows_total", gpu="0", cause="corrected") == 3.0
    assert v("gpuenergy_gpu_remapped_rows_total", gpu="0", cause="uncorrected") == 1.0
    assert v("gpuenergy_gpu_row_remap_pending", gpu="0") == 1.0
    assert v("gpuenergy_gpu_row_remap_failure", gpu="0") == 0.0
    assert v("gpuenergy_gpu_retired_pages", gpu="0", cause="single_bit") is None
    assert v("gpuenergy_gpu_retired_pages", gpu="2", cause="single_bit") == 4.0
    assert v("gpuenergy_gpu_retired_pages", gpu="2", cause="double_bit") == 1.0
    assert v("gpuenergy_gpu_retired_pages_pending", gpu="2") == 1.0
    assert v("gpuenergy_gpu_remapped_rows_total", gpu="2", cause="corrected") is None
    # PCIe: KB/s -> bytes/s (x 1024), link against its maximum
    assert v("gpuenergy_gpu_pcie_replays_total", gpu="0") == 42.0
    assert v("gpuenergy_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="tx") == 2000 * 1024
    assert v("gpuenergy_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="rx") == 500 * 1024
    assert (v("gpuenergy_gpu_pcie_link_generation", gpu="0"), v("gpuenergy_gpu_pcie_link_max_generation", gpu="0"),
            v("gpuenergy_gpu_pcie_link_width", gpu="0"), v("gpuenergy_gpu_pcie_link_max_width", gpu="0")) == (
        4.0, 5.0, 8.0, 16.0)
    assert v("gpuenergy_gpu_pcie_link_width", gpu="1") == 16.0
    # NVLink: links up, per-link errors, bytes (KiB x 1024); a down link counts nothing
    assert [v("gpuenergy_gpu_nvlink_up", gpu="0", link=str(n)) for n in range(5)] == [1.0, 1.0, 1.0, 0.0, None]
    assert v("gpuenergy_gpu_nvlink_errors_total", gpu="0", link="1", error="replay") == 7.0
    assert v("gpuenergy_gpu_nvlink_errors_total", gpu="0", link="1", error="recovery") == 2.0
    assert v("gpuenergy_gpu_nvlink_errors_total", gpu="0", link="1", error="crc_flit") == 11.0
    assert v("gpuenergy_gpu_nvlink_errors_total", gpu="0", link="1", error="crc_data") == 3.0
    assert v("gpuenergy_gpu_nvlink_errors_total", gpu="0", link="3", error="replay") is None
    assert v("gpuenergy_gpu_nvlink_data_bytes_total", gpu="0", link="1", direction="tx") == 1000 * 1024
    assert v("gpuenergy_gpu_nvlink_data_bytes_total", gpu="0", link="1", direction="rx") == 2000 * 1024
    assert len(list(samples(text, "gpuenergy_gpu_nvlink_up"))) == 4 + 18  # GPU 0: 4 links, GPU 1: 18
    assert v("gpuenergy_gpu_nvlink_up", gpu="2", link="0") is None
    # units and HELP on every health family
    for family in ("gpuenergy_gpu_xid_errors_total", "gpuenergy_gpu_pcie_throughput_bytes_per_second",
                   "gpuenergy_gpu_nvlink_data_bytes_total", "gpuenergy_gpu_ecc_errors_total"):
        assert f"# HELP {family} " in text, family
    assert v("gpuenergy_collector_success", collector="health") == 1.0
    assert v("gpuenergy_gpu_up", gpu="0") == 1.0  # a GPU with Xids is still sampled
    # a reading the GPU lacks is counted once as not supported, nothing more
    # (served by the gpu collector from the sample after the health read)
    text = wait_until(lambda: (lambda t: t if sample_value(t, "gpuenergy_nvml_field_errors_total", gpu="2",
                                                           field="remapped_rows") else None)(exp.metrics()),
                      timeout=30, what="GPU 2's remapped_rows field error")
    assert sample_value(text, "gpuenergy_nvml_field_errors_total", gpu="2", field="remapped_rows",
                        reason="not_supported") == 1.0
    assert sample_value(text, "gpuenergy_nvml_field_errors_total", gpu="1", field="retired_pages") is None
    # an Xid scripted later arrives while the exporter runs; the event set is freed at shutdown
    later = replace(sick, health=replace(sick.health, events=(*sick.health.events, xid(1.5, 48))))
    _write(tmp_path, Scenario(epoch=time.time() - 10, gpus=[later, healthy, pre_ampere]))
    wait_until(lambda: sample_value(exp.metrics(), "gpuenergy_gpu_xid_errors_total", gpu="0", xid="48") == 1.0,
               timeout=30, what="Xid 48 scripted while running never showed")
    start = time.monotonic()
    assert exp.stop() == 0
    assert time.monotonic() - start < 10  # the event thread's wait never holds up shutdown


def test_an_old_driver_without_health_functions_loses_nothing_else(
    start_exporter: type[ExporterProcess], tmp_path: Path
) -> None:
    lib = build_library(tmp_path / "oldlib", omit=HEALTH_FUNCTIONS)
    gpu = h100(0, power=Constant(300.0), health=replace(HEALTHY_H100, events=(xid(0.0, 79),)))
    env = _write(tmp_path, Scenario(epoch=time.time() - 10, gpus=[gpu]))
    exp = start_exporter([f"--nvml.library={lib}", *FAST], env).wait_ready()

    def served() -> str | None:
        text = exp.metrics()
        # the gpu collector serves the health read's field errors from the sample after it
        return text if sample_value(text, "gpuenergy_nvml_field_errors_total", field="remapped_rows") else None

    text = wait_until(served, timeout=30, what="the health collector's first read")
    assert sample_value(text, "gpuenergy_gpu_up", gpu="0") == 1.0
    assert sample_value(text, "gpuenergy_gpu_power_average_watts", gpu="0") == pytest.approx(300.0)
    assert sample_value(text, "gpuenergy_gpu_energy_joules_total", gpu="0") > 0
    assert sample_value(text, "gpuenergy_collector_success", collector="gpu") == 1.0
    assert sample_value(text, "gpuenergy_collector_success", collector="health") == 1.0  # no data is no failure
    for name in ("gpuenergy_gpu_ecc_errors_total", "gpuenergy_gpu_pcie_replays_total", "gpuenergy_gpu_nvlink_up",
                 "gpuenergy_gpu_xid_errors_total", "gpuenergy_gpu_remapped_rows_total"):
        assert not list(samples(text, name)), name
    assert sample_value(text, "gpuenergy_nvml_field_errors_total", field="remapped_rows",
                        reason="function_not_found") == 1.0
    assert "Traceback" not in exp.log()
    assert exp.stop() == 0


_CHILD = """
import ctypes, json, os, sys, time
sys.path.insert(0, {repo!r})
from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.collectors.health.collector import HealthCollector
from gpu_energy_exporter.devices import nvml
log = {log!r}
t = [0.0]
gpu = GPUCollector(lambda: nvml.NVMLBackend({lib!r}), retry_interval=0.0, power_interval=3600.0)
health = HealthCollector(gpu, interval=30.0, monotonic=lambda: t[0])
gpu.update()
first_inline = health.runs_inline()  # nothing read yet: a read is due
health.update()  # the first health read, and the event thread's registration
time.sleep(1.0)
# the event thread's calls (registration, then waits) are not the health read's
EVENTS = ("nvmlEventSet", "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceGetHandleByIndex")
def calls():
    with open(log) as f:
        return [line.split()[2] for line in f
                if line.split()[1] == str(os.getpid()) and not line.split()[2].startswith(EVENTS)]
start = len(calls())
inline = []
for _ in range(5):  # within the interval: no health NVML call (so the sampler runs it on its own thread)
    t[0] += 5.0
    inline.append(health.runs_inline())
    health.update()
between = calls()[start:]
t[0] += 30.0
start = len(calls())
inline.append(health.runs_inline())  # a read is due: on the health thread
health.update()  # one health read
read = calls()[start:]
lib = ctypes.CDLL({lib!r})
health.close()
outstanding = lib.fakeNvmlEventSetsOutstanding()
gpu.close()
print("@@OUT@@" + json.dumps({{"between": between, "read": read, "outstanding": outstanding,
                              "inline": [first_inline, *inline]}}))
"""


def test_health_reads_keep_their_cadence_and_call_budget(fake_nvml_lib: Path, tmp_path: Path) -> None:
    """Between health reads an update makes no NVML call (and says it may run inline); one read of an H100
    with 18 NVLinks makes the calls counted here (docs/health.md gives their cost on a real driver); the
    event set is freed at close."""
    import json

    path, log = tmp_path / "scenario.ini", tmp_path / "calls.log"
    Scenario(epoch=1_750_000_000.0, driver=Driver(frozen_time=1_750_000_100.0),
             gpus=[h100(0, health=HEALTHY_H100)]).write(path)
    log.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env.update(FAKE_NVML_SCENARIO=str(path), FAKE_NVML_CALL_LOG=str(log))
    script = textwrap.dedent(_CHILD.format(repo=str(REPO), lib=str(fake_nvml_lib), log=str(log)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.split("@@OUT@@", 1)[1])
    assert out["between"] == []
    read = Counter(out["read"])
    # ECC 4, remapped rows 1, PCIe 7 (replays, tx, rx, gen, max gen, width, max width), NVLink: 18 states,
    # 18 x 4 error counters, one field-values call for every link's bytes
    assert read == Counter({"nvmlDeviceGetTotalEccErrors": 4, "nvmlDeviceGetRemappedRows": 1,
                            "nvmlDeviceGetPcieReplayCounter": 1, "nvmlDeviceGetPcieThroughput": 2,
                            "nvmlDeviceGetCurrPcieLinkGeneration": 1, "nvmlDeviceGetMaxPcieLinkGeneration": 1,
                            "nvmlDeviceGetCurrPcieLinkWidth": 1, "nvmlDeviceGetMaxPcieLinkWidth": 1,
                            "nvmlDeviceGetNvLinkState": 18, "nvmlDeviceGetNvLinkErrorCounter": 72,
                            "nvmlDeviceGetFieldValues": 1}), dict(read)
    assert out["outstanding"] == 0
    # the sampler runs the update on its own thread only between reads (collectors.base.runs_inline)
    assert out["inline"] == [False, True, True, True, True, True, False]


def test_a_run_whose_gpu_reported_xid_79_carries_the_note_in_its_ledger_row(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    import csv

    from gpu_energy_exporter.training import start_run

    epoch = time.time() - 60
    # GPU 0 falls off the bus 3 s into the runs (Xid 79); GPU 1 stays healthy.
    sick = h100(0, power=Constant(400.0), health=replace(HEALTHY_H100, events=(xid(63.0, 79),)))
    healthy = h100(1, power=Constant(400.0), health=HEALTHY_H100)
    env = _write(tmp_path, Scenario(epoch=epoch, gpus=[sick, healthy]))
    runs_csv = tmp_path / "runs.csv"
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST, "--runs.warmup=0s", f"--runs.csv={runs_csv}"],
                         env).wait_ready()
    runs = {name: start_run(name, endpoint=exp.otlp_url, export_interval=0.5, gpu_uuids=[gpu.uuid])
            for name, gpu in (("on-sick-gpu", sick), ("on-healthy-gpu", healthy))}
    # run until the Xid has been received, and a little after
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for run in runs.values():
            run.step(tokens=1000, samples=1)
        if sample_value(exp.metrics(), "gpuenergy_gpu_xid_errors_total", gpu="0", xid="79") == 1.0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the Xid 79 never showed on /metrics")
    for _ in range(5):
        for run in runs.values():
            run.step(tokens=1000, samples=1)
        time.sleep(0.2)
    for run in runs.values():
        run.finish()

    def rows() -> dict[str, dict[str, str]] | None:
        if not runs_csv.exists():
            return None
        with runs_csv.open(newline="") as f:
            got = {r["run_id"]: r for r in csv.DictReader(f)}
        return got if len(got) == 2 else None

    got = wait_until(rows, timeout=30, what="both runs' ledger rows")
    note = got["on-sick-gpu"]["ledger_notes"]
    assert f"GPU 0 ({sick.uuid}) reported critical Xid 79 (GPU has fallen off the bus)" in note, note
    assert "drain the node and reset the GPU" in note
    assert "Xid" not in got["on-healthy-gpu"]["ledger_notes"]


def test_xid_notes_name_only_the_runs_gpus_critical_codes_inside_the_run() -> None:
    from gpu_energy_exporter.core.health import XidEvent
    from gpu_energy_exporter.ledger.health_notes import GRACE_S, xid_notes

    t0 = 1_750_000_000.0
    xids = (
        XidEvent(0, "GPU-aaaa", 13, t0 + 10),  # not critical
        XidEvent(0, "GPU-aaaa", 79, t0 + 20),
        XidEvent(0, "GPU-aaaa", 79, t0 + 30),
        XidEvent(0, "GPU-aaaa", 48, t0 + 40),
        XidEvent(1, "GPU-bbbb", 79, t0 + 20),  # another GPU
        XidEvent(0, "GPU-aaaa", 74, t0 - 5),  # before the run
    )
    # the run's GPU key as the ledger keeps it (frames.uuid_key: no "GPU-" prefix, lower case)
    (note,) = xid_notes(["aaaa"], t0, t0 + 100, xids)
    assert note.startswith("GPU 0 (GPU-aaaa) reported critical Xid 48 (double-bit ECC error), "
                           "79 (GPU has fallen off the bus) x2, first at 2025-06-15T15:07:00.000Z:"), note
    assert xid_notes(["cccc"], t0, t0 + 100, xids) == []
    assert xid_notes(["aaaa"], t0 + 50, t0 + 100, xids) == []
    # after the run's last point, within the grace: said so; beyond it: not the run's
    (late,) = xid_notes(["bbbb"], t0, t0 + 8, xids)
    assert "12s after the run's last point (it may have ended the run)" in late
    assert xid_notes(["bbbb"], t0, t0 + 20 - GRACE_S - 1, xids) == []


def test_older_event_wait_a_lost_gpu_and_the_interval_flag(
    start_exporter: type[ExporterProcess], tmp_path: Path
) -> None:
    """A driver without nvmlEventSetWait_v2 still delivers Xids through nvmlEventSetWait; a GPU lost at
    runtime loses only its own health series; --collector.health.interval refuses less than a second."""
    from gpu_energy_exporter.core.errors import ConfigError
    from gpu_energy_exporter.daemon.config import load_config

    lib = build_library(tmp_path / "lib", omit=("nvmlEventSetWait_v2",))
    g0 = h100(0, health=replace(HEALTHY_H100, events=(xid(0.0, 94),)))
    g1 = h100(1, health=HEALTHY_H100, lost_at_s=8.0)
    env = _write(tmp_path, Scenario(epoch=time.time(), gpus=[g0, g1]))
    exp = start_exporter([f"--nvml.library={lib}", *FAST, "--collector.health.interval=1s"], env).wait_ready()
    text = wait_until(lambda: (lambda t: t if sample_value(t, "gpuenergy_gpu_up", gpu="1") == 0.0 and sample_value(
        t, "gpuenergy_gpu_xid_errors_total", gpu="0", xid="94") == 1.0 else None)(exp.metrics()),
        timeout=40, what="Xid 94 through nvmlEventSetWait, and GPU 1 lost")
    time.sleep(1.5)  # a health read after the loss
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_gpu_pcie_link_width", gpu="0") == 16.0
    assert sample_value(text, "gpuenergy_gpu_pcie_link_width", gpu="1") is None
    assert sample_value(text, "gpuenergy_collector_success", collector="health") == 1.0
    assert "GPU 1: health read failed" in exp.log()
    assert exp.stop() == 0
    assert load_config(["--collector.health.interval=2m"], {}).collector_health_interval == 120.0
    assert load_config([], {"GPU_ENERGY_EXPORTER_COLLECTOR_HEALTH_INTERVAL": "45s"}).collector_health_interval == 45.0
    with pytest.raises(ConfigError, match="collector.health.interval must be at least 1s"):
        load_config(["--collector.health.interval=500ms"], {})
    assert "health" not in load_config(["--no-collector.health"], {}).collectors
