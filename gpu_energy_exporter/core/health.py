"""GPU health in base units: plain frozen values for ECC, row remapping, retired pages, PCIe, NVLink and Xid
events, and the Xid codes that mean "drain and reset".

``devices.nvml_health`` and ``devices.nvml_events`` build these values (vendor units such as the PCIe
throughput's KB/s and NVLink's KiB stop there); ``collectors.health`` exposes them; the sampler's snapshot
carries the recent critical Xids (``XidEvent``) to the run ledger. This module holds data only: it never
calls NVML, never reads a clock and never does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Xid codes after which the GPU must be drained and reset (NVIDIA's Xid catalogue, "Resolution" column):
#: the code and what it means, as alert and ledger texts name it.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
}

#: The ``error`` label values of the NVLink error counters, in nvmlNvLinkErrorCounter_t order.
NVLINK_ERRORS: tuple[str, ...] = ("replay", "recovery", "crc_flit", "crc_data")


@dataclass(frozen=True)
class NVLinkHealth:
    link: int
    up: bool
    errors: dict[str, int]  # NVLINK_ERRORS name -> count since driver load (readable ones only)
    tx_bytes: int | None = None  # data sent since driver load
    rx_bytes: int | None = None


@dataclass(frozen=True)
class GPUHealth:
    """One health reading of one GPU. Every field may be None (not supported here, or failed this time)."""

    timestamp: float  # unix time of the reading
    #: (error type, counter) -> count; error type "corrected" | "uncorrected", counter "volatile" (since
    #: driver load) | "aggregate" (lifetime of the GPU)
    ecc_errors: dict[tuple[str, str], int] | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    pcie_replays: int | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    pcie_link_gen: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    nvlinks: tuple[NVLinkHealth, ...] | None = None  # None: no NVLink (or not readable)


@dataclass(frozen=True)
class XidEvent:
    """An Xid the driver reported for a GPU, when the exporter received it (unix seconds)."""

    gpu_index: int
    gpu_uuid: str
    xid: int
    t: float

    @property
    def critical(self) -> bool:
        return self.xid in CRITICAL_XIDS


@dataclass(frozen=True)
class EventCounts:
    """What the event watcher has seen so far, per GPU index: a copy, safe to read on any thread."""

    watched: dict[int, bool]  # GPU index -> Xid events registered (False: not supported / not found)
    xids: dict[tuple[int, int], int]  # (GPU index, Xid code) -> count
    ecc: dict[tuple[int, str], int]  # (GPU index, "single_bit" | "double_bit") -> count
    last: dict[int, XidEvent]  # GPU index -> its last Xid
    critical: tuple[XidEvent, ...]  # the most recent critical Xids, oldest first (bounded)
    version: int = 0  # changes whenever anything above changes
