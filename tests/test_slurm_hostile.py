"""Files a tenant can write (issue 29, item 6): the Slurm job-mapping directory and the procfs files the sharing
reads are opened non-blocking and read only when regular (``core.tenantfiles``), bounded in total, read off
the sampler thread with a timeout, and ``gpuenergy_slurm_job_mapping_available`` says when the mapping could
not be read whole. In the real exporter on the fake NVML library: a FIFO at ``.info/<job>`` (it blocked the
collector in ``open()`` for ever, the mapping frozen and still "available") and 4,096 MIG-style files of 256
job ids (252,672 series, RSS 752 -> 1,554 MB) leave /metrics valid (promtool) and RSS bounded."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fakenvml import Constant, Scenario, h100
from helpers import ExporterProcess, require_binary, sample_value, samples, wait_until

from gpu_energy_exporter.collectors.slurm import mapping as slurm_mapping
from gpu_energy_exporter.collectors.slurm.collector import READ_TIMEOUT_S, SlurmCollector
from gpu_energy_exporter.collectors.slurm.mapping import JobMapping, read_mapping
from gpu_energy_exporter.core.state import GPUIdentity, GPUReading, GPUState
from gpu_energy_exporter.core.tenantfiles import NotRegular, Stuck, TooLarge, Watchdog, read_regular

AVAILABLE = "gpuenergy_slurm_job_mapping_available"
JOB_ENERGY = "gpuenergy_slurm_job_energy_joules_total"


# ----------------------------------------------------------------------------------------------------
# the pieces


def test_read_regular_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a blocking open() would wait for ever
    started = time.monotonic()
    with pytest.raises(NotRegular, match="a FIFO, not a regular file"):
        read_regular(fifo, 1024)
    assert time.monotonic() - started < 1.0
    with pytest.raises(NotRegular, match="a character device"):
        read_regular("/dev/zero", 1024)  # would never end
    with pytest.raises(NotRegular, match="a directory"):
        read_regular(tmp_path, 1024)
    (tmp_path / "big").write_bytes(b"7\n" * 1000)
    with pytest.raises(TooLarge):
        read_regular(tmp_path / "big", 1999)
    assert read_regular(tmp_path / "big", 2000) == b"7\n" * 1000
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(OSError):
        read_regular(tmp_path / "link", 4096)  # a symlink planted for another file is not followed


def test_a_watchdog_leaves_one_stuck_call_behind_and_recovers() -> None:
    release = threading.Event()
    dog = Watchdog("test-read", 0.2)
    assert dog.call(lambda x: x + 1, 1) == 2
    with pytest.raises(Stuck):
        dog.call(release.wait)
    started = time.monotonic()
    with pytest.raises(Stuck, match="has not returned"):
        dog.call(lambda: 1)  # refused at once while the first is stuck
    assert time.monotonic() - started < 0.1
    release.set()
    assert wait_until(lambda: _answers(dog), timeout=5, what="the watchdog answering again")
    assert dog.stuck_total == 1


def _answers(dog: Watchdog) -> bool:
    try:
        return dog.call(lambda: True)
    except Stuck:
        return False


def _state(index: int, uuid: str, energy: float) -> GPUState:
    ident = GPUIdentity(index, uuid, "NVIDIA H100 80GB HBM3", f"00000000:0{index}:00.0", "hopper", "9.0",
                        "counter", True)
    return GPUState(ident, True, GPUReading(0.0), energy, 0, 0.0)


def test_a_read_that_hangs_never_holds_the_collector_and_says_the_mapping_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "0").write_text("77\n")
    hang = threading.Event()
    hang.set()

    def read(directory: str, gpus: object) -> JobMapping:
        if not hang.is_set():
            threading.Event().wait(60)  # a read stuck in the kernel (a hung mount)
        return read_mapping(directory, gpus)  # type: ignore[arg-type]

    energy = [100.0]
    col = SlurmCollector(lambda: [_state(0, "GPU-0", energy[0])], str(tmp_path), clock=time.monotonic, read=read)

    def value(families: list, name: str, **labels: str) -> float | None:  # type: ignore[type-arg]
        for f in families:
            for s in f.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None

    assert value(col.update(), AVAILABLE) == 1.0
    hang.clear()
    (tmp_path / "0.new").write_text("77\n")  # the prolog rewrote the file: it is read again, and hangs
    os.rename(tmp_path / "0.new", tmp_path / "0")
    energy[0] = 150.0
    started = time.monotonic()
    families = col.update()
    assert time.monotonic() - started < READ_TIMEOUT_S + 1.0
    assert value(families, AVAILABLE) == 0.0
    assert value(families, JOB_ENERGY, job_id="77") == 50.0  # the mapping read before is kept
    started = time.monotonic()
    assert value(col.update(), AVAILABLE) == 0.0
    assert time.monotonic() - started < 0.5  # while the read is stuck, no sample waits for it again


def test_the_mapping_is_bounded_in_files_jobs_and_pairs(tmp_path: Path) -> None:
    for g in range(4096):
        (tmp_path / f"0.{g}").write_text("".join(f"{1000 + j}\n" for j in range(256)))
    (tmp_path / "1").write_text("5\n")  # another GPU's file, and GPU 2's, which this node does not have
    (tmp_path / "2").write_text("6\n")
    m = read_mapping(tmp_path, {0, 1})
    assert m.available and not m.complete
    assert sum(len(jobs) for jobs in m.gpus.values()) <= slurm_mapping.MAX_HOLDINGS
    assert len({j for jobs in m.gpus.values() for j in jobs}) <= slurm_mapping.MAX_JOBS
    assert (2, None) not in m.gpus
    assert any("(GPU, job) pairs" in p for p in m.problems)


# ----------------------------------------------------------------------------------------------------
# the exporter


def _exporter(start_exporter: type[ExporterProcess], lib: Path, tmp_path: Path, mapping: Path) -> ExporterProcess:
    path = tmp_path / "scenario.ini"
    Scenario(epoch=time.time(), gpus=[h100(0, power=Constant(300.0)), h100(1, power=Constant(200.0))]).write(path)
    return start_exporter([f"--nvml.library={lib}", "--collector.interval=200ms", "--collector.slurm",
                           f"--collector.slurm.job-mapping-dir={mapping}", "--no-collector.health"],
                          {"FAKE_NVML_SCENARIO": str(path)}).wait_ready()


def _promtool_ok(text: str) -> None:
    out = subprocess.run([require_binary("promtool"), "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[:2000]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_fifo_in_the_mapping_directory_blocks_nothing(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path,
) -> None:
    mapping = tmp_path / "map"
    (mapping / ".info").mkdir(parents=True)
    (mapping / "0").write_text("42\n")
    os.mkfifo(mapping / ".info" / "42")  # the job's info: a FIFO nobody writes
    os.mkfifo(mapping / "1")  # and a FIFO for GPU 1's file
    exp = _exporter(start_exporter, fake_nvml_lib, tmp_path, mapping)
    first = wait_until(lambda: sample_value(exp.metrics(), JOB_ENERGY, job_id="42", method="exclusive"),
                       timeout=30, what="job 42 charged")
    assert wait_until(lambda: (sample_value(exp.metrics(), JOB_ENERGY, job_id="42", method="exclusive") or 0) > first,
                      timeout=10, what="job 42's energy still counting")
    text = exp.metrics()
    assert sample_value(text, AVAILABLE) == 1.0  # the mapping was read; the FIFOs are skipped and said
    assert sample_value(text, "gpuenergy_slurm_job_info", job_id="42", user="", account="", partition="") == 1.0
    _promtool_ok(text)
    log = exp.log()
    assert ".info/42: a FIFO, not a regular file" in log and "1: a FIFO, not a regular file" in log


def test_4096_mig_style_files_of_256_jobs_leave_the_exporter_bounded(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path,
) -> None:
    mapping = tmp_path / "map"
    mapping.mkdir()
    exp = _exporter(start_exporter, fake_nvml_lib, tmp_path, mapping)
    wait_until(lambda: sample_value(exp.metrics(), AVAILABLE) == 1.0, timeout=30, what="the slurm collector")
    time.sleep(1.0)
    before = _rss_mb(exp.pid)
    for g in range(4096):  # 2 GPUs x 2,048 MIG-style files, each listing the same 256 jobs
        (mapping / f".{g % 2}.{g // 2}").write_text("".join(f"{9000 + j}\n" for j in range(256)))
        os.rename(mapping / f".{g % 2}.{g // 2}", mapping / f"{g % 2}.{g // 2}")
    text = wait_until(lambda: (lambda t: t if sample_value(t, JOB_ENERGY, job_id="9000", method="mig_slices")
                               else None)(exp.metrics()), timeout=60, what="the flood read")
    time.sleep(2.0)
    started = time.monotonic()
    text = exp.metrics()
    scrape_s = time.monotonic() - started
    grew = _rss_mb(exp.pid) - before
    series = sum(1 for _ in samples(text, "gpuenergy_slurm_gpu_job_info"))
    assert series <= slurm_mapping.MAX_HOLDINGS, series  # before: 252,672 series, RSS +800 MB, scrapes timing out
    assert sample_value(text, AVAILABLE) == 0.0  # more than the collector reads: said
    assert grew < 150, f"RSS grew {grew:.0f} MB"
    assert scrape_s < 5.0, scrape_s
    _promtool_ok(text)
    assert "more than 4096 (GPU, job) pairs or 1024 jobs" in exp.log()
