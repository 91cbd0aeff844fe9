"""When a GPU's counter and power fields were read, and where a frame puts them (issue 28): the driver's
timestamp of the batched field read, held within the exporter's read; a sample's wall-minus-monotonic offset
from the tightest of paired reads; a GPU read before its frame's time carried to it by its power."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from gpu_energy_exporter.collectors.gpu_tracks import reading_time, wall_minus_monotonic
from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity, GPUReading, GPUState
from gpu_energy_exporter.devices.nvml_calls import read_time
from gpu_energy_exporter.ledger.snapshot_frames import gpu_frame

OK, NOT_SUPPORTED = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED


def _field(ret: int, stamp_us: int) -> SimpleNamespace:
    return SimpleNamespace(nvmlReturn=ret, timestamp=stamp_us)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param([_field(OK, 100_000_250)], 100.00025, id="the driver's timestamp"),
        pytest.param([_field(OK, 99_000_000)], 99.0, id="the driver's clock, even where it is not ours"),
        pytest.param([_field(OK, 0)], 100.0005, id="no timestamp: the call's midpoint"),
        pytest.param([_field(NOT_SUPPORTED, 100_000_900), _field(OK, 100_000_100)], 100.0001,
                     id="the first answered field's timestamp"),
        pytest.param([_field(NOT_SUPPORTED, 100_000_900)], 100.0005, id="no field answered: the midpoint"),
    ],
)
def test_a_batched_field_read_is_dated_by_the_driver(fields: list[SimpleNamespace],
                                                                      expected: float) -> None:
    assert read_time(fields, 100.0, 100.001) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("fields_at", "expected"),
    [
        pytest.param(None, 10.0, id="no field read: when the read began"),
        pytest.param(1000.15, 10.15, id="the fields' wall time on the monotonic clock"),
        pytest.param(1003.0, 10.4, id="a wall clock stepped forward: held at the read's end"),
        pytest.param(990.0, 10.0, id="a wall clock stepped back: held at the read's start"),
    ],
)
def test_a_reading_is_timed_by_its_fields_on_the_monotonic_clock(fields_at: float | None, expected: float) -> None:
    r = GPUReading(timestamp=1000.0, fields_at=fields_at)
    assert reading_time(r, started=10.0, done=10.4, offset=990.0) == pytest.approx(expected)


def test_the_offset_comes_from_the_tightest_pair_of_clock_reads() -> None:
    """A thread that lost the GIL between its monotonic and wall reads (the first pair, 0.2 s apart) would
    date every reading of its sample by that wait: the next, tight pair is taken."""
    mono = iter([5.0, 5.2, 6.0, 6.00001])
    wall = iter([1005.1, 1006.000005])
    assert wall_minus_monotonic(lambda: next(wall), lambda: next(mono)) == pytest.approx(1000.0, abs=1e-5)


def _gpu(read_at: float, fields_at: float | None, power_w: float = 500.0) -> GPUState:
    ident = GPUIdentity(0, "GPU-0", "NVIDIA H100", "00000000:17:00.0", "hopper", "9.0", ENERGY_METHOD_COUNTER, True)
    r = GPUReading(timestamp=1000.0, power_average_w=power_w, fields_at=fields_at)
    return GPUState(ident, True, r, energy_j=10_000.0, energy_resets=0, last_good=1000.0, read_at=read_at)


@pytest.mark.parametrize(
    ("read_at", "fields_at", "expected_j"),
    [
        pytest.param(50.0, 1000.0, 10_000.0, id="the frame's latest read: as read"),
        pytest.param(49.8, 999.8, 10_100.0, id="read 0.2 s before the frame's time: 0.2 s of 500 W carried"),
        pytest.param(49.8, 1000.0, 10_000.0, id="a driver clock that stands still (a frozen test): none"),
        pytest.param(49.99, 999.5, 10_005.0, id="a driver stamp further back than the read times: their lag"),
        pytest.param(47.0, 997.0, 10_000.0, id="3 s before (a stuck read): not carried"),
        pytest.param(49.8, None, 10_000.0, id="no field read: not carried"),
    ],
)
def test_a_gpu_read_before_its_frames_time_is_carried_to_it_by_its_power(
    read_at: float, fields_at: float | None, expected_j: float
) -> None:
    """The frame's time is its latest GPU read (monotonic 50.0, driver 1000.0); an earlier read's energy goes
    on by its power reading to it (ledger.snapshot_frames.gpu_frame)."""
    frame = gpu_frame(_gpu(read_at, fields_at), ref=50.0, latest=1000.0)
    assert frame.energy_j == pytest.approx(expected_j)
