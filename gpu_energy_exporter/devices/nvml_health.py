"""GPU health through NVML: ECC counts, row remapping, retired pages, PCIe and NVLink, in base units.

``NVMLHealth.read`` takes one health reading of one GPU. Every call goes through the backend's
``nvml_calls.NVMLCalls``, so one failing or unsupported reading loses only itself: it is counted in
``gpuenergy_nvml_field_errors_total`` (field ``ecc_*``, ``remapped_rows``, ``pcie_*``, ``nvlink<N>_*``, ...)
and, when the driver says it does not exist here (``NOT_SUPPORTED``, a function an old driver lacks), never
asked again; only a lost GPU raises (``GPULost``). Vendor units stop here: the PCIe throughput's KB/s and
NVLink's KiB become bytes (NVML's "KB" is 1024 bytes, as in its other byte counts).

Health changes slowly, so the collector reads it at its own cadence (``--collector.health.interval``), on
its own collector thread: this module must never be called from the scrape path, nor at every sample.
Xid and ECC events are ``devices.nvml_events``.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from gpu_energy_exporter.core.health import NVLINK_ERRORS, EventCounts, GPUHealth, NVLinkHealth
from gpu_energy_exporter.core.state import GPUIdentity
from gpu_energy_exporter.devices.base import HealthReader
from gpu_energy_exporter.devices.nvml_calls import FieldValues, NVMLCalls
from gpu_energy_exporter.devices.nvml_events import EventWatcher

log = logging.getLogger(__name__)

_KIB = 1024
_ECC = (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
_SBE = pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
_DBE = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
_ECC_COUNTERS = (("volatile", pynvml.NVML_VOLATILE_ECC), ("aggregate", pynvml.NVML_AGGREGATE_ECC))
_NVLINK_ERROR_IDS = dict(zip(NVLINK_ERRORS, (
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
), strict=True))
_FI_NVLINK_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX  # KiB since driver load, scopeId = link
_FI_NVLINK_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
#: link ids NVML may answer for (nvml.h NVML_NVLINK_MAX_LINKS); the first link that is not there ends the list
_MAX_LINKS = int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))


def kib_to_bytes(kib: float) -> int:
    return int(kib) * _KIB


def pages(symbol: str = "nvmlDeviceGetRetiredPages") -> Callable[[Any, int], int]:
    """The number of pages retired for one cause in one call: pynvml's wrapper makes two (the count, then
    the addresses, which the exporter never uses)."""

    def count(h: Any, cause: int) -> int:
        fn = pynvml._nvmlGetFunctionPointer(symbol)  # noqa: SLF001 - raises FunctionNotFound if missing
        n = ctypes.c_uint(0)
        ret = fn(h, ctypes.c_int(cause), ctypes.byref(n), None)
        if ret not in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_INSUFFICIENT_SIZE):
            pynvml._nvmlCheckReturn(ret)  # noqa: SLF001 - pynvml's own error classes
        return int(n.value)

    count.__name__ = symbol
    return count


class NVMLHealth(HealthReader):
    """Health readings of the GPUs of one ``NVMLBackend`` (sharing its ``NVMLCalls``). One reader thread."""

    def __init__(self, calls: NVMLCalls, clock: Callable[[], float] = time.time) -> None:
        self._nvml = calls
        self._clock = clock
        self._links: dict[int, int] = {}  # GPU index -> NVLink links found (0: none)
        self._link_fields: dict[int, tuple[list[tuple[int, int]], FieldValues]] = {}
        self._retired = pages()
        self._watcher: EventWatcher | None = None

    def read(self, gpu: GPUIdentity) -> GPUHealth:
        i = gpu.index
        nv = self._nvml
        h = nv.handle(i)
        ecc: dict[tuple[str, str], int] = {}
        for kind, kind_id in _ECC:
            for counter, counter_id in _ECC_COUNTERS:
                v = nv.field(i, f"ecc_{kind}_{counter}", "nvmlDeviceGetTotalEccErrors", h, kind_id, counter_id)
                if v is not None:
                    ecc[(kind, counter)] = int(v)
        remap = nv.field(i, "remapped_rows", "nvmlDeviceGetRemappedRows", h)
        sbe = dbe = pending = None
        if remap is None:  # rows are remapped on Ampere and newer; pages retired before
            sbe = nv.field(i, "retired_pages", self._retired, h, _SBE)
            if sbe is not None:
                dbe = nv.field(i, "retired_pages", self._retired, h, _DBE)
                pending = nv.field(i, "retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
        replays = nv.field(i, "pcie_replays", "nvmlDeviceGetPcieReplayCounter", h)
        tx = nv.field(i, "pcie_throughput", "nvmlDeviceGetPcieThroughput", h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = (nv.field(i, "pcie_throughput", "nvmlDeviceGetPcieThroughput", h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
              if tx is not None else None)
        gen = nv.field(i, "pcie_link_gen", "nvmlDeviceGetCurrPcieLinkGeneration", h)
        gen_max = nv.field(i, "pcie_link_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", h)
        width = nv.field(i, "pcie_link_width", "nvmlDeviceGetCurrPcieLinkWidth", h)
        width_max = nv.field(i, "pcie_link_width_max", "nvmlDeviceGetMaxPcieLinkWidth", h)
        return GPUHealth(
            timestamp=self._clock(),
            ecc_errors=ecc or None,
            remapped_rows_corrected=int(remap[0]) if remap is not None else None,
            remapped_rows_uncorrected=int(remap[1]) if remap is not None else None,
            row_remap_pending=bool(remap[2]) if remap is not None else None,
            row_remap_failure=bool(remap[3]) if remap is not None else None,
            retired_pages_single_bit=int(sbe) if sbe is not None else None,
            retired_pages_double_bit=int(dbe) if dbe is not None else None,
            retired_pages_pending=bool(pending) if pending is not None else None,
            pcie_replays=int(replays) if replays is not None else None,
            pcie_tx_bytes_per_s=float(kib_to_bytes(tx)) if tx is not None else None,
            pcie_rx_bytes_per_s=float(kib_to_bytes(rx)) if rx is not None else None,
            pcie_link_gen=int(gen) if gen is not None else None,
            pcie_link_gen_max=int(gen_max) if gen_max is not None else None,
            pcie_link_width=int(width) if width is not None else None,
            pcie_link_width_max=int(width_max) if width_max is not None else None,
            nvlinks=self._nvlinks(i, h),
        )

    def _link_count(self, i: int, h: Any) -> int:
        """NVLink links of GPU ``i``, found once: link 0 answering NOT_SUPPORTED means no NVLink (one call,
        counted as not_supported once); the first link id NVML refuses ends the list."""
        n = self._links.get(i)
        if n is not None:
            return n
        n = 0
        if self._nvml.field(i, "nvlink", "nvmlDeviceGetNvLinkState", h, 0) is not None:
            n = 1
            while n < _MAX_LINKS:
                try:
                    pynvml.nvmlDeviceGetNvLinkState(h, n)
                except pynvml.NVMLError:
                    break  # INVALID_ARGUMENT (no such link) or NOT_SUPPORTED: the links end here
                n += 1
        self._links[i] = n
        if n:
            log.debug("GPU %d: %d NVLink link(s)", i, n)
        return n

    def _nvlinks(self, i: int, h: Any) -> tuple[NVLinkHealth, ...] | None:
        count = self._link_count(i, h)
        if not count:
            return None
        nv = self._nvml
        states = [nv.field(i, f"nvlink{n}_state", "nvmlDeviceGetNvLinkState", h, n) for n in range(count)]
        fields = self._link_fields.get(i)
        if fields is None:
            ids = [(fid, n) for n in range(count) for fid in (_FI_NVLINK_TX, _FI_NVLINK_RX)]
            fields = self._link_fields[i] = (ids, FieldValues(ids))
        names = {(fid, n): f"nvlink{n}_{'tx' if fid == _FI_NVLINK_TX else 'rx'}_bytes" for fid, n in fields[0]}
        kib = (nv.field_values(i, h, fields[0], names, fields[1])
               if not nv.unsupported(i, "field_values") else [None] * len(fields[0]))
        links: list[NVLinkHealth] = []
        for n, state in enumerate(states):
            if state is None:
                continue
            errors: dict[str, int] = {}
            if state:  # a link that is down counts nothing: its counters are not asked
                for name, counter in _NVLINK_ERROR_IDS.items():
                    v = nv.field(i, f"nvlink{n}_{name}_errors", "nvmlDeviceGetNvLinkErrorCounter", h, n, counter)
                    if v is not None:
                        errors[name] = int(v)
            tx, rx = kib[2 * n], kib[2 * n + 1]
            links.append(NVLinkHealth(
                link=n, up=bool(state), errors=errors,
                tx_bytes=kib_to_bytes(tx) if tx is not None else None,
                rx_bytes=kib_to_bytes(rx) if rx is not None else None,
            ))
        return tuple(links)

    # ------------------------------------------------------------------------------------------------
    # events

    def start_events(self, gpus: Sequence[GPUIdentity]) -> None:
        if self._watcher is None:
            self._watcher = EventWatcher([(g.index, g.uuid) for g in gpus], clock=self._clock)
            self._watcher.start()

    def events(self) -> EventCounts | None:
        return self._watcher.counts() if self._watcher is not None else None

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
