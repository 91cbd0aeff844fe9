"""The host collector: real psutil on this machine, and scripted psutil answers for exact arithmetic."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from helpers import ExporterProcess, registry_of, sample_value, wait_until
from prometheus_client import generate_latest

from gpu_energy_exporter.collectors.host import DEFAULT_MEMORY_CRITICAL_BYTES, HostCollector

LOGGER = "gpu_energy_exporter.collectors.host"
GiB = 1 << 30

# The shape psutil returns on Linux.
CpuTimes = namedtuple(
    "CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice"
)
VMem = namedtuple("VMem", "total available percent used free")
Swap = namedtuple("Swap", "total used free percent sin sout")


def script(values: list[CpuTimes]) -> Callable[[], CpuTimes]:
    it: Iterator[CpuTimes] = iter(values)
    return lambda: next(it)


def times(user: float = 0, system: float = 0, idle: float = 0, iowait: float = 0, guest: float = 0,
          steal: float = 0) -> CpuTimes:
    return CpuTimes(user, 0.0, system, idle, iowait, 0.0, 0.0, steal, guest, 0.0)


def fixed_host(cpu: Callable[[], CpuTimes], available: int = 8 * GiB, **kw: object) -> HostCollector:
    return HostCollector(
        cpu_times=cpu,
        cpu_count=lambda: 16,
        virtual_memory=lambda: VMem(64 * GiB, available, 0.0, 40 * GiB, 4 * GiB),
        swap_memory=lambda: Swap(2 * GiB, GiB // 2, 0, 0.0, 0, 0),
        **kw,  # type: ignore[arg-type]
    )


def test_real_psutil_values() -> None:
    c = HostCollector()
    c.update()
    # The kernel accounts CPU time in ticks (10 ms): wait until at least one has elapsed.
    deadline = time.monotonic() + 5
    while True:
        time.sleep(0.05)
        reg = registry_of(c.update())
        util = reg.get_sample_value("gpuenergy_host_cpu_utilization_ratio")
        if util is not None or time.monotonic() > deadline:
            break
    assert util is not None and 0.0 <= util <= 1.0
    assert reg.get_sample_value("gpuenergy_host_logical_cpus") == psutil.cpu_count()
    assert reg.get_sample_value("gpuenergy_host_memory_total_bytes") == psutil.virtual_memory().total
    available = reg.get_sample_value("gpuenergy_host_memory_available_bytes")
    assert available is not None and 0 < available <= psutil.virtual_memory().total
    assert reg.get_sample_value("gpuenergy_host_swap_total_bytes") == psutil.swap_memory().total
    assert reg.get_sample_value("gpuenergy_host_memory_critical_bytes") == DEFAULT_MEMORY_CRITICAL_BYTES


def test_swap_from_meminfo_is_what_psutil_reports() -> None:
    """The collector's own swap reader (meminfo alone) against psutil's, on this host's /proc."""
    from gpu_energy_exporter.collectors.host import swap_memory

    ours, theirs = swap_memory(), psutil.swap_memory()
    assert ours.total == theirs.total
    assert abs(ours.used - theirs.used) <= 64 << 20  # the two reads are moments apart


def test_swap_reader_parses_meminfo(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from gpu_energy_exporter.collectors.host import swap_memory

    (tmp_path / "meminfo").write_text("MemTotal:       32000000 kB\nSwapCached:            0 kB\n"
                                      "SwapTotal:       2097148 kB\nSwapFree:        1048572 kB\n")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    got = swap_memory()
    assert (got.total, got.used) == (2097148 * 1024, (2097148 - 1048572) * 1024)


def test_utilization_is_the_busy_share_between_updates() -> None:
    c = fixed_host(script([
        times(user=100, system=50, idle=800, iowait=50),
        # +30 user +10 system +50 idle +10 iowait: busy 40 of 100
        times(user=130, system=60, idle=850, iowait=60),
    ]))
    first = registry_of(c.update())
    assert first.get_sample_value("gpuenergy_host_cpu_utilization_ratio") is None  # nothing to compare yet
    second = registry_of(c.update())
    assert second.get_sample_value("gpuenergy_host_cpu_utilization_ratio") == pytest.approx(0.4)


def test_guest_time_is_not_counted_twice() -> None:
    # Linux already includes guest time in user: +20 user of which +20 guest, +20 idle -> 50% busy.
    c = fixed_host(script([times(user=100, idle=100, guest=50), times(user=120, idle=120, guest=70)]))
    c.update()
    assert registry_of(c.update()).get_sample_value("gpuenergy_host_cpu_utilization_ratio") == pytest.approx(0.5)


def test_no_elapsed_ticks_keeps_the_last_value() -> None:
    same = times(user=130, system=60, idle=850, iowait=60)
    c = fixed_host(script([times(user=100, system=50, idle=800, iowait=50), same, same]))
    c.update()
    c.update()
    assert registry_of(c.update()).get_sample_value("gpuenergy_host_cpu_utilization_ratio") == pytest.approx(0.4)


def test_counters_going_backwards_are_clamped() -> None:
    # A CPU taken offline can make the summed counters step back; never expose a ratio outside 0..1.
    c = fixed_host(script([times(user=500, idle=500), times(user=400, idle=700)]))
    c.update()
    util = registry_of(c.update()).get_sample_value("gpuenergy_host_cpu_utilization_ratio")
    assert util == 0.0


def test_memory_and_swap_gauges() -> None:
    reg = registry_of(fixed_host(script([times(idle=1)])).update())
    assert reg.get_sample_value("gpuenergy_host_memory_total_bytes") == 64 * GiB
    assert reg.get_sample_value("gpuenergy_host_memory_available_bytes") == 8 * GiB
    assert reg.get_sample_value("gpuenergy_host_memory_used_bytes") == 40 * GiB
    assert reg.get_sample_value("gpuenergy_host_swap_total_bytes") == 2 * GiB
    assert reg.get_sample_value("gpuenergy_host_swap_used_bytes") == GiB // 2
    assert reg.get_sample_value("gpuenergy_host_logical_cpus") == 16


def test_custom_critical_threshold_is_exposed() -> None:
    reg = registry_of(fixed_host(script([times(idle=1)]), memory_critical_bytes=3 * GiB).update())
    assert reg.get_sample_value("gpuenergy_host_memory_critical_bytes") == 3 * GiB


def test_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError):
        HostCollector(memory_critical_bytes=-1)


def test_low_memory_warns_once_per_crossing(caplog: pytest.LogCaptureFixture) -> None:
    available = iter([4 * GiB, GiB // 2, GiB // 4, GiB // 4, 2 * GiB, GiB // 2])
    c = HostCollector(
        cpu_times=lambda: times(idle=1),
        cpu_count=lambda: 4,
        virtual_memory=lambda: VMem(16 * GiB, next(available), 0.0, 0, 0),
        swap_memory=lambda: Swap(0, 0, 0, 0.0, 0, 0),
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(6):
            c.update()
    levels = [r.levelno for r in caplog.records if r.name == LOGGER]
    # below (warn), still below x2 (quiet), recovered (info), below again (warn)
    assert levels == [logging.WARNING, logging.INFO, logging.WARNING]
    assert "critically low" in caplog.records[0].getMessage()


def test_unknown_cpu_count_is_no_series() -> None:
    c = HostCollector(
        cpu_times=lambda: times(idle=1),
        cpu_count=lambda: None,
        virtual_memory=lambda: VMem(GiB, GiB, 0.0, 0, 0),
        swap_memory=lambda: Swap(0, 0, 0, 0.0, 0, 0),
    )
    assert registry_of(c.update()).get_sample_value("gpuenergy_host_logical_cpus") is None


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus package) not installed")
def test_exposition_passes_promtool_lint() -> None:
    c = HostCollector()
    c.update()
    text = generate_latest(registry_of(c.update()))
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


PROCFS = Path(__file__).parent / "fixtures" / "procfs-host"


@pytest.fixture
def restore_procfs() -> Iterator[None]:
    saved = psutil.PROCFS_PATH
    yield
    psutil.PROCFS_PATH = saved


@pytest.mark.usefixtures("restore_procfs")
def test_procfs_root_is_where_host_memory_is_read() -> None:
    # Regression: --path.procfs was parsed and documented but psutil always read this machine's /proc.
    reg = registry_of(HostCollector(procfs=str(PROCFS)).update())
    assert reg.get_sample_value("gpuenergy_host_memory_total_bytes") == 16 * GiB
    assert reg.get_sample_value("gpuenergy_host_memory_available_bytes") == 4 * GiB


def test_exporter_reads_host_memory_under_path_procfs(start_exporter: type[ExporterProcess]) -> None:
    exp = start_exporter(["--no-collector.gpu", f"--path.procfs={PROCFS}", "--collector.interval=200ms"]).wait_ready()

    def host_memory() -> str | None:
        text = exp.get()[1]
        return text if "gpuenergy_host_memory_total_bytes" in text else None

    text = wait_until(host_memory, what="host memory series")
    assert sample_value(text, "gpuenergy_host_memory_total_bytes") == 16 * GiB
    assert sample_value(text, "gpuenergy_host_memory_available_bytes") == 4 * GiB


def test_memory_and_swap_from_one_meminfo_read_are_what_psutil_reports() -> None:
    """The default reader (one read of /proc/meminfo a sample for both) against psutil's two, on this host."""
    from gpu_energy_exporter.collectors.host import Meminfo

    m = Meminfo()
    vm, sw = m.virtual_memory(), m.swap_memory()
    theirs_vm, theirs_sw = psutil.virtual_memory(), psutil.swap_memory()
    assert vm.total == theirs_vm.total and sw.total == theirs_sw.total
    assert abs(vm.available - theirs_vm.available) <= 64 << 20  # the reads are moments apart
    assert vm.used == vm.total - vm.available
    assert abs(vm.used - theirs_vm.used) <= 64 << 20
    assert abs(sw.used - theirs_sw.used) <= 64 << 20


def test_swap_comes_from_the_read_memory_made(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from gpu_energy_exporter.collectors.host import Meminfo

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
                       "SwapTotal:       2097148 kB\nSwapFree:        1048572 kB\n")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    m = Meminfo()
    vm = m.virtual_memory()
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   1 kB\nSwapTotal: 4 kB\nSwapFree: 0 kB\n")
    sw = m.swap_memory()  # the same sample: no second read
    assert (vm.total, vm.available, vm.used) == (32000000 * 1024, 20000000 * 1024, 12000000 * 1024)
    assert (sw.total, sw.used) == (2097148 * 1024, (2097148 - 1048572) * 1024)
    assert m.swap_memory().total == 4 * 1024  # a swap read on its own reads again


def test_available_over_total_is_free_memory_as_psutil_says(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from gpu_energy_exporter.collectors.host import Meminfo

    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemFree: 300 kB\nMemAvailable: 5000 kB\n"
                                      "SwapTotal: 0 kB\nSwapFree: 0 kB\n")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    vm = Meminfo().virtual_memory()
    assert (vm.available, vm.used) == (300 * 1024, 700 * 1024)
