"""GPU health in a fake NVML scenario: ECC, row remapping, retired pages, PCIe, NVLink and scripted events.

``Health`` is the ``health`` field of a ``scenario.GPU``; ``lines()`` renders it as the keys of the
"Health" section of fakenvml.c (README.md). A reading left ``None`` answers ``NOT_SUPPORTED`` there, as on
a GPU or driver without it. Events (``xid(t, code)``, ``ecc_event(t, double_bit)``) are delivered by
``nvmlEventSetWait_v2`` once their time (seconds since the scenario's epoch) has come. This module must
never load the library or pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass

#: nvmlEventType bits (nvml.h).
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
ALL_EVENTS = EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC | EVENT_XID


@dataclass(frozen=True)
class Event:
    """At ``t_s`` seconds since the epoch, an event of ``event_type`` with ``data`` (the Xid code)."""

    t_s: float
    event_type: int
    data: int = 0


def xid(t_s: float, code: int) -> Event:
    return Event(t_s, EVENT_XID, code)


def ecc_event(t_s: float, double_bit: bool) -> Event:
    return Event(t_s, EVENT_DOUBLE_BIT_ECC if double_bit else EVENT_SINGLE_BIT_ECC)


@dataclass(frozen=True)
class PCIe:
    replays: int = 0
    tx_kb_per_s: int = 0  # KB/s, as nvmlDeviceGetPcieThroughput reports it
    rx_kb_per_s: int = 0
    gen: int = 5
    max_gen: int = 5
    width: int = 16
    max_width: int = 16


@dataclass(frozen=True)
class NVLink:
    """Per link: up, error counters (replay, recovery, crc_flit, crc_data), KiB sent and received."""

    up: bool = True
    replay: int = 0
    recovery: int = 0
    crc_flit: int = 0
    crc_data: int = 0
    tx_kib: int = 0
    rx_kib: int = 0


@dataclass(frozen=True)
class Health:
    #: (corrected volatile, uncorrected volatile, corrected aggregate, uncorrected aggregate)
    ecc: tuple[int, int, int, int] | None = None
    #: (corrected, uncorrected, pending, failure)
    remapped_rows: tuple[int, int, int, int] | None = None
    #: (single-bit pages, double-bit pages, pending)
    retired_pages: tuple[int, int, int] | None = None
    pcie: PCIe | None = None
    nvlinks: tuple[NVLink, ...] = ()
    event_types: int | None = ALL_EVENTS  # None: nvmlDeviceGetSupportedEventTypes NOT_SUPPORTED (vGPU)
    events: tuple[Event, ...] = ()
    #: from its time on, every event wait returns this event at once (a GPU flooding Xids)
    flood: Event | None = None

    def lines(self) -> list[str]:
        out: list[str] = []
        if self.ecc is not None:
            out.append("ecc = " + " ".join(str(v) for v in self.ecc))
        if self.remapped_rows is not None:
            out.append("remapped_rows = " + " ".join(str(v) for v in self.remapped_rows))
        if self.retired_pages is not None:
            out.append("retired_pages = " + " ".join(str(v) for v in self.retired_pages))
        if self.pcie is not None:
            p = self.pcie
            out.append(f"pcie = {p.replays} {p.tx_kb_per_s} {p.rx_kb_per_s} {p.gen} {p.max_gen} {p.width} "
                       f"{p.max_width}")
        if self.nvlinks:
            if len(self.nvlinks) > 18:
                raise ValueError("at most 18 NVLinks")
            out.append("nvlink = " + " ".join("1" if link.up else "0" for link in self.nvlinks))
            for n, link in enumerate(self.nvlinks):
                out.append(f"nvlink_errors = {n} {link.replay} {link.recovery} {link.crc_flit} {link.crc_data}")
                out.append(f"nvlink_kib = {n} {link.tx_kib} {link.rx_kib}")
        if self.event_types is not None:
            out.append(f"event_types = 0x{self.event_types:x}")
        if len(self.events) > 32:
            raise ValueError("at most 32 events per GPU")
        for e in self.events:
            out.append(f"event = {float(e.t_s)!r} {e.event_type} {e.data}")
        if self.flood is not None:
            out.append(f"event_flood = {float(self.flood.t_s)!r} {self.flood.event_type} {self.flood.data}")
        return out


#: A healthy H100 SXM: ECC on, no errors, PCIe Gen5 x16, 18 NVLinks up, Xid and ECC events supported.
HEALTHY_H100 = Health(ecc=(0, 0, 0, 0), remapped_rows=(0, 0, 0, 0), pcie=PCIe(),
                      nvlinks=tuple(NVLink() for _ in range(18)))

#: The driver-generation matrix's Hopper (tests/golden/drivers/hopper.prom): a few corrected errors, a
#: PCIe link at its maximum with some traffic and replays, two NVLink links (an NVLink bridge) with traffic.
HOPPER_GENERATION = Health(
    ecc=(2, 0, 14, 0), remapped_rows=(1, 0, 0, 0),
    pcie=PCIe(replays=3, tx_kb_per_s=1200, rx_kb_per_s=3400),
    nvlinks=(NVLink(tx_kib=4096, rx_kib=8192, crc_flit=1), NVLink(tx_kib=2048, rx_kib=1024)),
)
