"""The GPU health series: their specs, and a health reading or the event counts turned into samples.

Pure: ``emit_health`` adds one ``core.health.GPUHealth`` (already in base units) to the families of one
health read, ``emit_events`` the Xid and ECC event counts; neither converts a unit, reads a clock or calls
NVML. The collector that drives them is ``collectors.health``.
"""

from __future__ import annotations

from prometheus_client.core import Metric

from gpu_energy_exporter.core.health import CRITICAL_XIDS, EventCounts, GPUHealth
from gpu_energy_exporter.core.metrics import GPU_LABELS, Kind, MetricSpec, add, define

_G = GPU_LABELS


def _gpu(name: str, kind: Kind, help: str, extra: tuple[str, ...] = (), unit: str = "") -> MetricSpec:
    return define("gpu", name, kind, help, _G + extra, collector="health", unit=unit)


_CRITICAL = ", ".join(f"{code} ({what})" for code, what in sorted(CRITICAL_XIDS.items()))

XID_ERRORS = _gpu(
    "xid_errors_total", "counter",
    "Xid errors the driver reported for the GPU since the exporter started, by Xid code (NVML critical-Xid "
    f"events). The codes that need a drain and reset ({_CRITICAL}) start at 0 on every GPU whose events are "
    "watched, so increase() sees their first one.",
    ("xid",),
)
LAST_XID = _gpu("last_xid", "gauge", "Code of the last Xid error the GPU reported (since the exporter started).")
LAST_XID_TIME = _gpu(
    "last_xid_timestamp_seconds", "gauge", "Unix time at which the exporter received the GPU's last Xid error.",
    unit="seconds",
)
XID_WATCHED = _gpu(
    "xid_events_watched", "gauge",
    "1 if the exporter receives the GPU's Xid events; 0 where the driver offers none (vGPU, older drivers): "
    "no Xid series there is then no evidence of health.",
)
ECC_EVENTS = _gpu(
    "ecc_events_total", "counter",
    "ECC error events the driver reported since the exporter started, by type (single_bit: corrected, "
    "double_bit: uncorrected).",
    ("type",),
)
ECC_ERRORS = _gpu(
    "ecc_errors_total", "counter",
    "ECC memory errors (nvmlDeviceGetTotalEccErrors) by error_type (corrected | uncorrected) and counter "
    "(volatile: since the driver loaded; aggregate: the GPU's lifetime). Absent where ECC is off or missing.",
    ("error_type", "counter"),
)
REMAPPED_ROWS = _gpu(
    "remapped_rows_total", "counter",
    "Memory rows remapped (Ampere and newer), by cause: corrected (correctable errors) or uncorrected.",
    ("cause",),
)
REMAP_PENDING = _gpu(
    "row_remap_pending", "gauge",
    "1 if a row remap is pending: it takes effect at the next GPU reset (drain the GPU, then reset it).",
)
REMAP_FAILURE = _gpu(
    "row_remap_failure", "gauge",
    "1 if a row remap failed (no spare rows left): the GPU needs service (RMA).",
)
RETIRED_PAGES = _gpu(
    "retired_pages", "gauge",
    "Memory pages retired (before Ampere), by cause: single_bit (repeated corrected errors) or double_bit.",
    ("cause",),
)
RETIRED_PENDING = _gpu(
    "retired_pages_pending", "gauge", "1 if a page retirement waits for the next GPU reset or reboot.",
)
PCIE_REPLAYS = _gpu(
    "pcie_replays_total", "counter",
    "PCIe replays (link-level retransmissions) since the driver loaded: a rising rate means a marginal link.",
)
PCIE_THROUGHPUT = _gpu(
    "pcie_throughput_bytes_per_second", "gauge",
    "PCIe throughput in bytes per second by direction (tx: from the GPU, rx: to the GPU), as the driver "
    "measured it over about 20 ms at the last health read (NVML's KB/s taken as KiB/s).",
    ("direction",),
)
PCIE_GEN = _gpu("pcie_link_generation", "gauge", "Current PCIe link generation (drops while idle on some boards).")
PCIE_GEN_MAX = _gpu("pcie_link_max_generation", "gauge", "Highest PCIe link generation the GPU and slot support.")
PCIE_WIDTH = _gpu("pcie_link_width", "gauge", "Current PCIe link width, in lanes.")
PCIE_WIDTH_MAX = _gpu("pcie_link_max_width", "gauge", "Widest PCIe link the GPU and slot support, in lanes.")
NVLINK_UP = _gpu("nvlink_up", "gauge", "1 if the NVLink link is active, 0 if it is down.", ("link",))
NVLINK_ERRORS = _gpu(
    "nvlink_errors_total", "counter",
    "NVLink errors per link since the driver loaded, by error: replay, recovery, crc_flit, crc_data.",
    ("link", "error"),
)
NVLINK_DATA = _gpu(
    "nvlink_data_bytes_total", "counter",
    "NVLink payload bytes per link since the driver loaded, by direction (tx, rx); rate() gives throughput.",
    ("link", "direction"), unit="bytes",
)
HEALTH_READ_TIME = define(
    "health", "last_read_timestamp_seconds", "gauge",
    "Unix time of the last health read (ECC, remapping, PCIe, NVLink), taken every --collector.health.interval.",
    collector="health", unit="seconds",
)
HEALTH_READ_DURATION = define(
    "health", "last_read_duration_seconds", "gauge",
    "Time the last health read of every GPU took (its NVML calls).", collector="health", unit="seconds",
)

READ_SPECS = [ECC_ERRORS, REMAPPED_ROWS, REMAP_PENDING, REMAP_FAILURE, RETIRED_PAGES, RETIRED_PENDING, PCIE_REPLAYS,
              PCIE_THROUGHPUT, PCIE_GEN, PCIE_GEN_MAX, PCIE_WIDTH, PCIE_WIDTH_MAX, NVLINK_UP, NVLINK_ERRORS,
              NVLINK_DATA]
EVENT_SPECS = [XID_WATCHED, XID_ERRORS, LAST_XID, LAST_XID_TIME, ECC_EVENTS]


def _b(flag: bool) -> float:
    return 1.0 if flag else 0.0


def emit_health(fams: dict[str, Metric], h: GPUHealth, labels: list[str]) -> None:
    """The samples of one GPU's health reading (every field that could be read)."""

    def put(spec: MetricSpec, value: float | None, *extra: str) -> None:
        if value is not None:
            add(fams[spec.name], [*labels, *extra], float(value))

    for (error_type, counter), n in sorted((h.ecc_errors or {}).items()):
        put(ECC_ERRORS, n, error_type, counter)
    put(REMAPPED_ROWS, h.remapped_rows_corrected, "corrected")
    put(REMAPPED_ROWS, h.remapped_rows_uncorrected, "uncorrected")
    put(REMAP_PENDING, None if h.row_remap_pending is None else _b(h.row_remap_pending))
    put(REMAP_FAILURE, None if h.row_remap_failure is None else _b(h.row_remap_failure))
    put(RETIRED_PAGES, h.retired_pages_single_bit, "single_bit")
    put(RETIRED_PAGES, h.retired_pages_double_bit, "double_bit")
    put(RETIRED_PENDING, None if h.retired_pages_pending is None else _b(h.retired_pages_pending))
    put(PCIE_REPLAYS, h.pcie_replays)
    put(PCIE_THROUGHPUT, h.pcie_tx_bytes_per_s, "tx")
    put(PCIE_THROUGHPUT, h.pcie_rx_bytes_per_s, "rx")
    put(PCIE_GEN, h.pcie_link_gen)
    put(PCIE_GEN_MAX, h.pcie_link_gen_max)
    put(PCIE_WIDTH, h.pcie_link_width)
    put(PCIE_WIDTH_MAX, h.pcie_link_width_max)
    for link in h.nvlinks or ():
        name = str(link.link)
        put(NVLINK_UP, _b(link.up), name)
        for error, count in link.errors.items():
            put(NVLINK_ERRORS, count, name, error)
        put(NVLINK_DATA, link.tx_bytes, name, "tx")
        put(NVLINK_DATA, link.rx_bytes, name, "rx")


def emit_events(fams: dict[str, Metric], counts: EventCounts, uuids: dict[int, str]) -> None:
    """The Xid and ECC event series of every GPU in ``uuids`` (NVML index -> UUID)."""
    for index, uuid in sorted(uuids.items()):
        labels = [str(index), uuid]
        watched = counts.watched.get(index)
        if watched is None:
            continue  # registration still under way
        add(fams[XID_WATCHED.name], labels, _b(watched))
        xids = {xid: n for (i, xid), n in counts.xids.items() if i == index}
        if watched:
            for code in CRITICAL_XIDS:
                xids.setdefault(code, 0)
        for xid, n in sorted(xids.items()):
            add(fams[XID_ERRORS.name], [*labels, str(xid)], float(n))
        last = counts.last.get(index)
        if last is not None:
            add(fams[LAST_XID.name], labels, float(last.xid))
            add(fams[LAST_XID_TIME.name], labels, last.t)
        for kind in ("single_bit", "double_bit"):
            seen = counts.ecc.get((index, kind))
            if seen is not None or watched:
                add(fams[ECC_EVENTS.name], [*labels, kind], float(seen or 0))
