"""The device backend interface.

Everything above this line (sampler, collectors, ledger) sees GPUs only through ``GPUBackend``. The NVML
implementation (``devices.nvml``) is the only module that imports ``pynvml``; ``devices.simulated`` backs
the ``demo`` sub-command. Units are in the field names (``_mj``, ``_mw``, ``_bytes``, ``_mhz``) exactly as
the vendor reports them; conversion to base units (J, W) happens once, in the collectors.

A field of ``None`` means "not available on this GPU/driver" (not supported, missing function) or "could
not be read this time": no series is emitted for it, and the backend counts why (``field_errors``).
``GPULost`` means the whole GPU is gone; any other exception out of ``read`` is a bug or a sick GPU, and the
collector treats it like a lost GPU for that sample, for that GPU alone.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

#: How a GPU's energy counter is obtained (the ``energy_method`` info label).
ENERGY_METHOD_COUNTER = "counter"  # nvmlDeviceGetTotalEnergyConsumption (Volta and newer)
ENERGY_METHOD_INTEGRATED_INSTANT = "integrated_instant_power"  # trapezoid over NVML_FI_DEV_POWER_INSTANT
ENERGY_METHOD_INTEGRATED_USAGE = "integrated_power_usage"  # trapezoid over nvmlDeviceGetPowerUsage
ENERGY_METHOD_NONE = "none"  # no power reading at all


@dataclass(frozen=True)
class GPUIdentity:
    """What does not change while the driver stays loaded."""

    index: int  # NVML index (not the CUDA_VISIBLE_DEVICES index)
    uuid: str  # "GPU-..." (stable across reboots; the join key)
    name: str  # product name, e.g. "NVIDIA H100 80GB HBM3"
    pci_bus_id: str  # "00000000:17:00.0"
    architecture: str  # "volta", "ampere", "hopper", ... or "unknown"
    compute_capability: str  # "9.0" or ""
    energy_method: str  # one of ENERGY_METHOD_*
    #: nvmlDeviceGetPowerUsage is a 1 s average (Ampere+ except GA100) rather than instant power.
    power_usage_is_average: bool
    mig_enabled: bool = False
    mig_devices: tuple[MIGDevice, ...] = ()


@dataclass(frozen=True)
class MIGDevice:
    uuid: str  # "MIG-..."
    parent_uuid: str
    index: int  # MIG device index within the parent


@dataclass(frozen=True)
class GPUProcess:
    pid: int
    used_memory_bytes: int | None
    sm_util_pct: float | None = None  # from nvmlDeviceGetProcessUtilization, when available


@dataclass(frozen=True)
class GPUReading:
    """One sample of one GPU. Every reading field may be None (not available)."""

    timestamp: float  # time.time() when the sample was taken
    energy_mj: int | None = None  # nvmlDeviceGetTotalEnergyConsumption, raw (may go backwards)
    power_instant_mw: float | None = None
    power_average_mw: float | None = None  # ~1 s average
    module_power_mw: float | None = None  # Grace Hopper module scope (GPU + CPU + memory)
    power_limit_mw: float | None = None  # enforced limit
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    util_gpu_pct: float | None = None
    util_memory_pct: float | None = None
    temperature_gpu_c: float | None = None
    temperature_memory_c: float | None = None
    clock_sm_mhz: float | None = None
    clock_memory_mhz: float | None = None
    clocks_event_reasons: int | None = None  # NVML bitmask
    processes: tuple[GPUProcess, ...] | None = None
    gpm: dict[str, float] = field(default_factory=dict)  # GPM metric name -> percent 0..100


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
             gpm: bool = False) -> GPUReading:
        """A full sample of one GPU. Raises ``GPULost`` when the GPU is gone; fields that cannot be read
        are None. The running processes are read only when asked for (``processes``: the list;
        ``process_utilization``: the list with each process's SM utilisation), else ``processes`` is None."""

    @abc.abstractmethod
    def read_power_mw(self, gpu: GPUIdentity) -> float | None:
        """The cheapest instant power reading (for the fast integrating sampler), or None."""

    def field_errors(self) -> dict[tuple[int, str, str], int]:
        """Readings lost so far: ``(gpu index, field, reason) -> count``. Backends that cannot lose a single
        reading return nothing."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional
        """Release the library."""
