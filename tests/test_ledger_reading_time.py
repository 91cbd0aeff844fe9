"""A frame is dated at the time its GPUs were read, not at the time its snapshot was published.

The energy a snapshot carries for a GPU is the energy at the moment of its reading; the sampler publishes the
snapshot only once every collector finished, which on a loaded machine can be tenths of a second later. The
ledger charges each run the part of every interval between two frames that the run overlaps, so a frame dated
at the publication moves that lag's worth of power across a run's edges. Plain values, hand-computed: a
constant 300 W, one reading a second, snapshots published late around the run's end.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from fakenvml import Constant, Scenario, h100
from helpers import GPURig
from test_ledger import T0, UUID_A, Clock, Harness, constant, gpu_state, summary_of, trainer

from gpu_energy_exporter.core.state import Snapshot
from gpu_energy_exporter.devices.nvml import NVMLBackend
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.snapshot_frames import frame_of

#: The monotonic clock's reading at T0: another origin than the wall clock's, as on a real machine.
MONO0 = 5_000.0


class LateHarness(Harness):
    """Reads the GPUs at every whole second and publishes each snapshot ``lags[k]`` seconds later (k: seconds
    since T0); the ledger receives it at the publication."""

    def __init__(self, ledger: RunLedger, clock: Clock, lags: dict[int, float]) -> None:
        self.lags = lags
        super().__init__(ledger, clock, {UUID_A: constant(300.0)})

    def snap_at(self, t: float) -> None:
        published = t + self.lags.get(round(t - T0), 0.0)
        self.clock.t = published
        gpu = replace(gpu_state(UUID_A, t, self.traces[UUID_A]), read_at=MONO0 + (t - T0))
        self.ledger.on_snapshot(Snapshot(seq=round(t - T0), timestamp=published, families=(), results=(),
                                         gpus=(gpu,), monotonic=MONO0 + (published - T0)))


@pytest.mark.parametrize("steady", [False, True], ids=["wall-stamped", "steady-clock"])
@pytest.mark.parametrize("lags", [{19: 0.6}, {11: 0.6}, {11: 0.45, 12: 0.3, 18: 0.1, 19: 0.7, 20: 0.2}],
                         ids=["late-after-end", "late-after-start", "late-throughout"])
def test_a_run_is_charged_the_energy_of_its_own_seconds_whenever_the_snapshots_are_published(
    tmp_path: Path, steady: bool, lags: dict[int, float]
) -> None:
    """8 s at 300 W: 2,400 J exactly, as with snapshots published on time. Before (frames dated at the
    publication): 2,343.75 J with the snapshot after the end 0.6 s late (the interval read from 18 to 19 s
    spread over 18 to 19.6 s: 93.75 of its 150 J inside the run), 2,456.25 J with the one after the start
    0.6 s late."""
    clock = Clock(T0)
    ledger = RunLedger(str(tmp_path / "runs.csv"), warmup_s=0.0, stale_after_s=300.0, clock=clock,
                       wall=clock if steady else None)
    h = LateHarness(ledger, clock, lags)
    h.run_until(T0 + 10)
    pushes = trainer(h, "r1", T0 + 10.5, T0 + 18.5, rate=1000.0, every=1.0)
    h.run_until(T0 + 24, pushes)
    s = summary_of(ledger, "r1")
    assert s["status"] == "finished"
    assert s["duration_s"] == pytest.approx(8.0)
    assert s["energy_j"] == pytest.approx(2400.0, rel=1e-9)


def test_the_sampler_and_the_gpu_collector_stamp_the_reading_time_on_one_clock(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's pieces (GPU collector and sampler on their default clocks): a frame is dated at its GPU
    reading, a little before the snapshot's publication, never after it."""
    path = tmp_path / "scenario.ini"
    Scenario(epoch=time.time() - 60.0, gpus=[h100(0, power=Constant(300.0))]).write(path)
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    rig = GPURig(lambda: NVMLBackend(str(fake_nvml_lib)), gpm=False)
    try:
        rig.sample()
        snap = rig.sampler.snapshot
        assert snap is not None and snap.monotonic is not None
        read_at = snap.gpus[0].read_at
        assert read_at is not None and read_at <= snap.monotonic
        frame = frame_of(snap, None, None)
        assert frame.age == pytest.approx(snap.monotonic - read_at) and frame.age > 0.0
        assert frame.t == pytest.approx(snap.timestamp - frame.age)
    finally:
        rig.close()



@pytest.mark.parametrize(("read_at", "age"), [(MONO0 + 99.7, 0.3), (MONO0 + 85.0, 0.0), (MONO0 + 100.5, 0.0)],
                         ids=["read-0.3s-before", "stuck-collector-15s", "another-clock"])
def test_a_frame_is_dated_by_its_reading_only_when_the_reading_is_recent(read_at: float, age: float) -> None:
    """A GPU collector stuck in a hung driver call has its last states carried on: 15 s old, the frame keeps
    its snapshot's time (runs still close while the driver hangs); a reading stamped after the publication is
    on another clock."""
    gpu = replace(gpu_state(UUID_A, T0 + 99.7, constant(300.0)), read_at=read_at)
    snap = Snapshot(seq=1, timestamp=T0 + 100.0, families=(), results=(), gpus=(gpu,), monotonic=MONO0 + 100.0)
    frame = frame_of(snap, None, None)
    assert frame.age == pytest.approx(age)
    assert frame.t == pytest.approx(T0 + 100.0 - age)
    down = replace(gpu, up=False)  # a GPU that is down dates nothing
    assert frame_of(replace(snap, gpus=(down,)), None, None).t == T0 + 100.0
