"""The running-process list's cadence (issue 28's cost target): read afresh at every counter read (a run's, job's
or pod's edge is one), with every per-process utilisation ask, when the GPU's used memory moved, and otherwise
every ``PROCESS_LIST_INTERVAL_S`` (5 s) of the backend's clock; the last list is served between.

The production path (``collectors.gpu`` and ``devices.nvml`` through pynvml) against the fake library, on a
frozen clock the test steps (the fake's ``frozen_time``, the backend's clock and the collector's monotonic
clock are one): every figure is exact whatever the machine's load. The calls are counted by the exporter's own
per-function counts (``gpuenergy_nvml_calls_total``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakenvml import GPU, Driver, Process, Scenario, h100
from helpers import GPURig

from gpu_energy_exporter.devices.nvml import PROCESS_LIST_INTERVAL_S, NVMLBackend

T0 = 1_750_000_000.0
LIST = "nvmlDeviceGetComputeRunningProcesses_v3"
GIB = 1 << 30
TRAINER = Process(4242, 8 * GIB, 80)


class Rig(GPURig):
    """The GPU collector at the daemon's schedule (a sample a second, the counter every 30 s) on the fake."""

    def __init__(self, lib: Path, path: Path, gpus: list[GPU], **kw) -> None:  # type: ignore[no-untyped-def]
        self.path, self.t = path, T0 + 100.0
        self.gpus = gpus
        self.write()
        kw.setdefault("energy_interval", 30.0)
        super().__init__(lambda: NVMLBackend(str(lib), clock=self.now), clock=self.now, monotonic=self.now,
                         interval=1.0, gpm=False, power_interval=3600.0, **kw)

    def now(self) -> float:
        return self.t

    def write(self) -> None:
        Scenario(epoch=T0, driver=Driver(frozen_time=self.t), gpus=self.gpus).write(self.path)

    def at(self, t: float, gpus: list[GPU] | None = None) -> bool:
        """One sample at ``t`` (with ``gpus`` from then on); whether it read the process list."""
        self.t = t
        if gpus is not None:
            self.gpus = gpus
        self.write()
        before = self.lists()
        self.sample()
        return self.lists() > before

    def lists(self) -> int:
        backend = self.collector.backend
        return 0 if backend is None else backend.call_costs().get(LIST, (0, 0.0))[0]

    def listed(self, i: int = 0) -> float | None:
        return self.value("gpuenergy_gpu_compute_processes", gpu=str(i), gpu_uuid=self.gpus[i].uuid)


@pytest.fixture
def rig(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:  # type: ignore[type-arg]
    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    made: list[Rig] = []

    def make(gpus: list[GPU], **kw) -> Rig:  # type: ignore[no-untyped-def]
        r = Rig(fake_nvml_lib, path, gpus, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_the_list_is_read_every_5_s_and_at_every_counter_read(rig) -> None:  # type: ignore[no-untyped-def]
    """Steady state, memory unchanged: the list is read at the counter reads (every 30 s) and 5 s after the
    last read between them; the samples in between serve the last list."""
    assert PROCESS_LIST_INTERVAL_S == 5.0
    r = rig([h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))])
    start = r.t
    read_at = [t - start for t in (start + k for k in range(0, 91)) if r.at(t)]
    # the counter's first spans after start-up are short (read at 0, 2, 6, 14, 30 s, then every 30 s)
    counter_reads = [0, 2, 6, 14, 30, 60, 90]
    expected = sorted({*counter_reads, 11, 19, 24, 29, 35, 40, 45, 50, 55, 65, 70, 75, 80, 85})
    assert read_at == expected
    assert r.listed() == 1.0  # every sample serves the list, read or held


def test_a_run_edge_reads_the_list_in_that_sample(rig) -> None:  # type: ignore[no-untyped-def]
    """A run's start or finish asks for a counter read (``request_counter_read``): that sample reads the list
    too, however recently it was read (settlement splits the span that read closes by who was listed)."""
    r = rig([h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))])
    for k in range(41):
        r.at(T0 + 100 + k)  # the list last read at 140 (the counter read at 130, then 135 and 140)
    assert not r.at(T0 + 141)
    r.collector.request_counter_read()
    assert r.at(T0 + 141.5)
    assert not r.at(T0 + 142)


def test_a_process_that_starts_or_ends_is_listed_at_the_next_sample_when_memory_moves(  # type: ignore[no-untyped-def]
        rig) -> None:
    """A CUDA context takes GPU memory: a process starting or ending moves the GPU's used memory, and the list
    is read in the first sample that sees it move, as when it was read every second. A process that lives
    between two samples only (under a second) is seen by neither schedule."""
    idle = [h100(0, memory_used_bytes=1 * GIB)]
    r = rig(idle)
    for k in range(41):
        r.at(T0 + 100 + k)  # the list last read at 140
    assert r.listed() == 0.0
    busy = [h100(0, memory_used_bytes=9 * GIB, processes=(TRAINER,))]
    assert r.at(T0 + 140.2, busy)  # 0.2 s after a list read at 140: memory moved
    assert r.listed() == 1.0
    assert not r.at(T0 + 141.2, busy)  # unchanged since: held
    assert r.listed() == 1.0
    assert r.at(T0 + 142.2, idle)  # it ended: memory moved back
    assert r.listed() == 0.0


def test_without_a_memory_change_a_new_process_is_listed_within_5_s(rig) -> None:  # type: ignore[no-untyped-def]
    """The bound when the used memory does not move (another process freeing exactly what the new one took):
    the list is read again 5 s after the last read, never later."""
    r = rig([h100(0, memory_used_bytes=10 * GIB)])
    for k in range(41):
        r.at(T0 + 100 + k)  # the list last read at 140
    swapped = [h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))]
    seen = []
    for k in range(1, 8):
        r.at(T0 + 140 + k, swapped)
        seen.append(r.listed())
    assert seen[:4] == [0.0, 0.0, 0.0, 0.0]  # 141..144: the list read at 140
    assert seen[4:] == [1.0, 1.0, 1.0]  # 145: 5 s after the last read, and on


def test_a_failed_read_is_asked_again_at_the_next_sample(rig) -> None:  # type: ignore[no-untyped-def]
    """A list the driver could not give (a transient error) is not held: the next sample asks again, and the
    processes are absent (not an old list) while it fails."""
    ok = [h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))]
    failing = [h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,),
                    function_error={LIST: 999})]  # NVML_ERROR_UNKNOWN
    r = rig(ok)
    for k in range(41):
        r.at(T0 + 100 + k)  # the list last read at 140
    assert r.at(T0 + 145, failing)  # due
    assert r.listed() is None
    assert r.at(T0 + 146, failing)  # asked again, not held
    assert r.listed() is None
    assert r.at(T0 + 147, ok)
    assert r.listed() == 1.0
    assert not r.at(T0 + 148, ok)


def test_the_per_process_series_read_the_list_every_sample(rig) -> None:  # type: ignore[no-untyped-def]
    """``--collector.processes`` exposes each process's memory: the list is read at every sample."""
    r = rig([h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))], processes=True)
    assert all(r.at(T0 + 100 + k) for k in range(12))


def test_the_clock_stepping_back_reads_the_list_again(rig) -> None:  # type: ignore[no-untyped-def]
    r = rig([h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))])
    for k in range(41):
        r.at(T0 + 100 + k)  # the list last read at 140
    assert not r.at(T0 + 140.5)
    assert r.at(T0 + 120)  # rather than hold the list for ever


def test_real_time_is_not_the_clock(rig) -> None:  # type: ignore[no-untyped-def]
    """The cadence follows the backend's clock (the rig's frozen one), not the seconds the test takes."""
    r = rig([h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))])
    for k in range(41):
        r.at(T0 + 100 + k)  # the list last read at 140
    time.sleep(0.05)
    assert [r.at(T0 + 140 + 0.01 * k) for k in range(1, 5)] == [False] * 4


def test_the_exposed_call_counts_follow_every_read(rig) -> None:  # type: ignore[no-untyped-def]
    """``gpuenergy_nvml_calls_total`` and ``..._call_seconds_total`` per function are the backend's own counts
    at every sample: those called in it move, the others (the list between its reads, the power limit between
    its 10 s reads) are served as they stand."""
    r = rig([h100(0, memory_used_bytes=10 * GIB, processes=(TRAINER,))])
    for k in range(20):
        r.at(T0 + 100 + k)
        costs = r.collector.backend.call_costs()
        for fn in (LIST, "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTemperature"):
            assert r.value("gpuenergy_nvml_calls_total", function=fn) == costs[fn][0], (k, fn)
            assert r.value("gpuenergy_nvml_call_seconds_total", function=fn) == costs[fn][1], (k, fn)
    assert r.value("gpuenergy_nvml_calls_total", function="nvmlDeviceGetTemperature") >= 20
