"""Xid and ECC events through NVML: a thread of its own that waits on an NVML event set and counts them.

``EventWatcher`` creates one event set (``nvmlEventSetCreate``), registers every GPU for the event types
among critical Xid, single-bit and double-bit ECC that the GPU supports (``nvmlDeviceGetSupportedEventTypes``,
``nvmlDeviceRegisterEvents``), then waits (``nvmlEventSetWait_v2``, else the older ``nvmlEventSetWait``) with
a bounded timeout, so ``stop()`` is prompt, and frees the set (``nvmlEventSetFree``) when it ends. The wait
blocks in the driver (0.11 ms of CPU per 200 ms wait on an H100: it does not spin) with the GIL released.

Events that do not exist here (older drivers, vGPU: ``NOT_SUPPORTED``, ``FUNCTION_NOT_FOUND``) are no data,
not errors: logged once at info, and the GPU shows as not watched. Any other failure of the wait is logged
once and retried after a pause.

Under a flood (a sick GPU, or a driver answering every wait with an event) the thread reads at most
``MAX_EVENTS_PER_S`` events a second and then sleeps out the second, so it costs a bounded share of a core
(the driver's queue holds the rest, and drops what overflows it: counts can then fall behind); each GPU's Xid
code is logged at most ``XID_LOG_BURST`` times a minute, with a count of the lines left out
(``core.ratelog``). The thread never blocks sampling or shutdown: the collector reads a copy of
the counts (``counts()``), and a wait stuck in a sick driver is left behind (daemon thread) at shutdown.
This module must never be called from the scrape path and never converts a unit.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from gpu_energy_exporter.core.health import EventCounts, XidEvent
from gpu_energy_exporter.core.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

EVENT_XID = pynvml.nvmlEventTypeXidCriticalError
EVENT_SBE = pynvml.nvmlEventTypeSingleBitEccError
EVENT_DBE = pynvml.nvmlEventTypeDoubleBitEccError
_WANTED = EVENT_XID | EVENT_SBE | EVENT_DBE
#: Errors meaning "events do not exist here": no data.
_NO_EVENTS = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
#: The most recent critical Xids kept (all GPUs), for the run ledger's notes.
KEEP_CRITICAL = 64
#: Events read per second at most (all GPUs): a real GPU reports a handful; past it the thread sleeps out
#: the second. Each read costs the thread ~0.1 ms of CPU (an H100's wait, and the counting): 2% of a core.
MAX_EVENTS_PER_S = 200
#: Log lines per GPU and Xid code per minute (each one's count is exact in gpuenergy_gpu_xid_errors_total).
XID_LOG_BURST = 5


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


class EventWatcher:
    """Counts Xid and ECC events of ``gpus`` (``(NVML index, UUID)`` pairs) on a daemon thread."""

    def __init__(self, gpus: Sequence[tuple[int, str]], *, clock: Callable[[], float] = time.time,
                 wait_ms: int = 500, retry_s: float = 5.0) -> None:
        self._gpus = list(gpus)
        self._clock = clock
        self._wait_ms = wait_ms
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the counts below
        self._watched: dict[int, bool] = {}
        self._xids: dict[tuple[int, int], int] = {}
        self._ecc: dict[tuple[int, str], int] = {}
        self._last: dict[int, XidEvent] = {}
        self._critical: deque[XidEvent] = deque(maxlen=KEEP_CRITICAL)
        self._version = 0
        self._thread: threading.Thread | None = None
        self._symbol = "nvmlEventSetWait_v2"
        self._xid_log = RateLimitedLog(log, period_s=60.0, burst=XID_LOG_BURST, clock=time.monotonic)
        self._flood_log = RateLimitedLog(log, period_s=300.0, clock=time.monotonic)
        self._second = 0.0  # monotonic start of the second events are counted in
        self._in_second = 0
        self.throttled_s = 0.0  # time slept out under a flood

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end and wait for it (at most one wait timeout and a margin)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._wait_ms / 1000.0 + 1.0 if timeout is None else timeout)
            if self._thread.is_alive():
                log.warning("the NVML event thread is still in a driver call (slow or hung driver?); leaving it")

    def counts(self) -> EventCounts:
        with self._lock:
            return EventCounts(dict(self._watched), dict(self._xids), dict(self._ecc), dict(self._last),
                               tuple(self._critical), self._version)

    # ------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self._no_events("", exc)
            return
        except Exception as exc:  # noqa: BLE001 - events are worth a log line, never the exporter
            log.warning("NVML events unavailable (%s: %s); no Xid counts", type(exc).__name__, exc)
            self._set_watched(dict.fromkeys((i for i, _ in self._gpus), False))
            return
        try:
            by_handle = self._register(event_set)
            if by_handle:
                self._loop(event_set, by_handle)
        finally:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except Exception as exc:  # noqa: BLE001 - at shutdown the library may be gone already
                log.debug("nvmlEventSetFree: %s", exc)

    def _no_events(self, what: str, exc: BaseException) -> None:
        log.info("NVML events not available%s (%s): no Xid counts there; every other reading goes on", what, exc)
        self._set_watched(dict.fromkeys((i for i, _ in self._gpus), False))

    def _set_watched(self, watched: dict[int, bool]) -> None:
        with self._lock:
            self._watched.update(watched)
            self._version += 1

    def _register(self, event_set: Any) -> dict[int | None, tuple[int, str]]:
        by_handle: dict[int | None, tuple[int, str]] = {}
        for index, uuid in self._gpus:
            watched = False
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(index)
                types = pynvml.nvmlDeviceGetSupportedEventTypes(h) & _WANTED
                if types:
                    pynvml.nvmlDeviceRegisterEvents(h, types, event_set)
                    by_handle[_address(h)] = (index, uuid)
                    watched = bool(types & EVENT_XID)
                else:
                    log.info("GPU %d: the driver offers no Xid or ECC events here; no Xid counts", index)
            except pynvml.NVMLError as exc:
                if getattr(exc, "value", None) in _NO_EVENTS:
                    log.info("GPU %d: NVML events not supported (%s): no Xid counts (vGPU or older driver)",
                             index, exc)
                else:
                    log.warning("GPU %d: cannot register for NVML events (%s); no Xid counts for it", index, exc)
            except Exception as exc:  # noqa: BLE001
                log.warning("GPU %d: cannot register for NVML events (%s: %s)", index, type(exc).__name__, exc)
            self._set_watched({index: watched})
        return by_handle

    def _wait(self, event_set: Any, data: Any) -> None:
        try:
            fn = pynvml._nvmlGetFunctionPointer(self._symbol)  # noqa: SLF001 - as pynvml's wrapper
        except pynvml.NVMLError_FunctionNotFound:
            if self._symbol == "nvmlEventSetWait":
                raise
            self._symbol = "nvmlEventSetWait"  # a driver before _v2: the same call, older name
            fn = pynvml._nvmlGetFunctionPointer(self._symbol)  # noqa: SLF001
        pynvml._nvmlCheckReturn(fn(event_set, ctypes.byref(data), ctypes.c_uint(self._wait_ms)))  # noqa: SLF001

    def _loop(self, event_set: Any, by_handle: dict[int | None, tuple[int, str]]) -> None:
        data = pynvml.c_nvmlEventData_t()
        logged = False
        while not self._stop.is_set():
            try:
                self._wait(event_set, data)
            except pynvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == pynvml.NVML_ERROR_TIMEOUT:
                    self._xid_log.flush()  # a quiet wait: what a flood left out of the log is said now
                    continue
                if code in _NO_EVENTS:
                    self._no_events(" (waiting)", exc)
                    return
                if not logged:
                    log.warning("waiting for NVML events failed (%s); retrying every %gs, Xid counts may miss "
                                "events meanwhile", exc, self._retry_s)
                    logged = True
                self._stop.wait(self._retry_s)
                continue
            except Exception as exc:  # noqa: BLE001
                log.warning("NVML event wait raised %s: %s; retrying in %gs", type(exc).__name__, exc, self._retry_s)
                self._stop.wait(self._retry_s)
                continue
            self._throttle()
            gpu = by_handle.get(_address(data.device))
            if gpu is None:
                continue
            self._record(gpu[0], gpu[1], int(data.eventType), int(data.eventData))

    def _throttle(self) -> None:
        """After ``MAX_EVENTS_PER_S`` events in a second, sleep out the second (``stop()`` still wakes it)."""
        now = time.monotonic()
        if now - self._second >= 1.0:
            self._second, self._in_second = now, 0
        self._in_second += 1
        if self._in_second > MAX_EVENTS_PER_S:
            rest = self._second + 1.0 - now
            self._flood_log.warning("flood", "NVML events: more than %d a second; reading at most that many (Xid "
                                    "and ECC counts may fall behind the driver's while it lasts)", MAX_EVENTS_PER_S)
            self._stop.wait(rest)
            self.throttled_s += rest
            self._second, self._in_second = time.monotonic(), 0

    def _record(self, index: int, uuid: str, event_type: int, event_data: int) -> None:
        now = self._clock()
        with self._lock:
            self._version += 1
            if event_type & EVENT_XID:
                key = (index, event_data)
                self._xids[key] = self._xids.get(key, 0) + 1
                event = XidEvent(index, uuid, event_data, now)
                self._last[index] = event
                if event.critical:
                    self._critical.append(event)
            if event_type & EVENT_SBE:
                self._ecc[(index, "single_bit")] = self._ecc.get((index, "single_bit"), 0) + 1
            if event_type & EVENT_DBE:
                self._ecc[(index, "double_bit")] = self._ecc.get((index, "double_bit"), 0) + 1
        if event_type & EVENT_XID:
            self._xid_log.warning((index, event_data), "GPU %d (%s) reported Xid %d", index, uuid, event_data)
