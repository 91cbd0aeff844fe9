"""When a GPU's counter and power fields were read (issue 28): the driver's timestamp of the batched field
read, held within the call, and a sample's wall-minus-monotonic offset from the tightest of paired reads."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from gpu_energy_exporter.collectors.gpu_tracks import reading_time, wall_minus_monotonic
from gpu_energy_exporter.core.state import GPUReading
from gpu_energy_exporter.devices.nvml_calls import read_time

OK, NOT_SUPPORTED = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED


def _field(ret: int, stamp_us: int) -> SimpleNamespace:
    return SimpleNamespace(nvmlReturn=ret, timestamp=stamp_us)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param([_field(OK, 100_000_250)], 100.00025, id="the driver's timestamp, within the call"),
        pytest.param([_field(OK, 99_000_000)], 100.0, id="a timestamp before the call is held at its start"),
        pytest.param([_field(OK, 200_000_000)], 100.001, id="a timestamp after the call is held at its end"),
        pytest.param([_field(OK, 0)], 100.0005, id="no timestamp: the call's midpoint"),
        pytest.param([_field(NOT_SUPPORTED, 100_000_900), _field(OK, 100_000_100)], 100.0001,
                     id="the first answered field's timestamp"),
        pytest.param([_field(NOT_SUPPORTED, 100_000_900)], 100.0005, id="no field answered: the midpoint"),
    ],
)
def test_a_batched_field_read_is_dated_by_the_driver_within_the_call(fields: list[SimpleNamespace],
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
