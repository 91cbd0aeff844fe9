"""The device backend interface.

Everything above this line (sampler, collectors, ledger) sees GPUs only through ``GPUBackend``. The NVML
implementation (``devices.nvml``, with ``nvml_calls`` and the health modules ``nvml_health`` and ``nvml_events``)
is the only code that imports ``pynvml``; ``devices.simulated`` backs
the ``demo`` sub-command. Vendor units stop here: a backend returns ``core.state.GPUReading`` in base units
(J, W, ratios, Hz, bytes), converted once, in the backend, and nothing above converts again.

A field of ``None`` means "not available on this GPU/driver" (not supported, missing function) or "could
not be read this time": no series is emitted for it, and the backend counts why (``field_errors``).
``GPULost`` means the whole GPU is gone; any other exception out of ``read`` is a bug or a sick GPU, and the
collector treats it like a lost GPU for that sample, for that GPU alone.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from gpu_energy_exporter.core.health import EventCounts, GPUHealth
from gpu_energy_exporter.core.state import GPUIdentity, GPUReading

# Vendor units to base units: the one place they are converted. Each keeps the arithmetic /metrics always
# used for it (x 1e-3 for power, x 0.01 for percentages, / 1000 for the energy counter): the two ways round
# differ in the last bit for some values (41 x 0.01 = 0.41000000000000003, 41 / 100 = 0.41), and the
# exposed bytes stay as they were.


def joules(millijoules: float) -> float:
    """The driver's energy counter (integer millijoules) in joules."""
    return millijoules / 1000.0


def watts(milliwatts: float) -> float:
    return milliwatts * 1e-3


def ratio(percent: float) -> float:
    return percent * 0.01


def hertz(megahertz: float) -> float:
    return megahertz * 1e6

class GPUBackend(abc.ABC):
    """A source of GPU readings. Methods may block (the driver can be slow); never call them from the
    scrape path."""

    #: Short name shown in logs and in the build/backend info ("nvml", "simulated").
    kind: str = ""

    @abc.abstractmethod
    def driver_version(self) -> str: ...

    @abc.abstractmethod
    def devices(self) -> list[GPUIdentity]:
        """Every GPU, discovered once at start-up."""

    @abc.abstractmethod
    def read(self, gpu: GPUIdentity, *, processes: bool = False, process_utilization: bool = False,
             gpm: bool = False, energy: bool = True, fresh_processes: bool = True) -> GPUReading:
        """A full sample of one GPU. Raises ``GPULost`` when the GPU is gone; fields that cannot be read
        are None. The running processes are read only when asked for (``processes``: the list;
        ``process_utilization``: the list with each process's SM utilisation), else ``processes`` is None.
        ``fresh_processes`` False: the list may be one the backend read at an earlier sample, where reading it
        costs (``devices.nvml.PROCESS_LIST_INTERVAL_S`` says when it is read again).
        ``energy``: read the energy counter (a few ms of CPU on a real driver), else ``energy_j`` is None."""

    @abc.abstractmethod
    def read_power_w(self, gpu: GPUIdentity) -> float | None:
        """The cheapest instant power reading in watts (for the fast integrating sampler), or None."""

    def field_errors(self) -> dict[tuple[int, str, str], int]:
        """Readings lost so far: ``(gpu index, field, reason) -> count``. Backends that cannot lose a single
        reading return nothing."""
        return {}

    def health_reader(self) -> HealthReader | None:
        """GPU health readings and events (``collectors.health``), or None where the backend has none."""
        return None
    def call_costs(self) -> dict[str, tuple[int, float]]:
        """What the library calls cost so far: ``function -> (calls, CPU seconds of the calling thread)``.
        Backends with no library to call return nothing."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional
        """Release the library."""


class HealthReader(abc.ABC):
    """GPU health: ECC, row remapping, retired pages, PCIe, NVLink (``read``, slow-changing: read at the
    health cadence, never per sample) and Xid / ECC events (counted by a thread of the reader's own)."""

    @abc.abstractmethod
    def read(self, gpu: GPUIdentity) -> GPUHealth:
        """One health reading; raises ``GPULost`` when the GPU is gone, unreadable fields are None."""

    def start_events(self, gpus: Sequence[GPUIdentity]) -> None:  # noqa: B027 - optional
        """Start counting the events of ``gpus`` (returns at once; the waiting is another thread's)."""

    def events(self) -> EventCounts | None:
        """The events counted so far, or None where events are not watched."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Stop the event thread. Call before the backend's own close (which shuts NVML down)."""
