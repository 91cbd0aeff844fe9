"""Calling NVML one reading at a time: the error translation every NVML call of ``devices.nvml`` goes through.

Whatever one call raises (an ``NVMLError``, pynvml's ``NVMLLibraryMismatchError`` when an unversioned
wrapper needs a symbol this driver lacks, an ``AttributeError`` because the installed pynvml has no such
wrapper, or anything else) loses that one reading and nothing more. Each failure is counted per GPU, field
and reason (``field_errors()``, exposed as ``gpuenergy_nvml_field_errors_total``) and logged once per GPU and
field. Calls that NVML versions (``..._v3``, ``..._v2``, unversioned) fall back to the older variant when the
newer one is missing. "Not supported" and "function not found" after the last variant are cached per GPU and
field: an unavailable reading costs one failed call in the whole life of the process. Only a lost GPU
(``GPU_IS_LOST`` and friends) is raised, as ``GPULost``.

This module knows NVML's return codes and calling conventions, never what a reading means or its unit
(``devices.nvml`` does); it must never be called from the scrape path.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import pynvml

from gpu_energy_exporter.core.errors import GPULost, NVMLUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors meaning "this reading does not exist here": no data, asked once.
_NO_DATA = {
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    pynvml.NVML_ERROR_DEPRECATED,
}
# Errors meaning "nothing to read right now": no data this time, asked again next sample, logged at debug.
_NOT_NOW = {
    pynvml.NVML_ERROR_NO_DATA,
    pynvml.NVML_ERROR_NOT_READY,
}
# Errors meaning the GPU itself is gone or unusable until reset.
_LOST = {
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED,
    pynvml.NVML_ERROR_GPU_NOT_FOUND,
}

#: ``reason`` label values of ``field_errors()`` (the ``gpuenergy_nvml_field_errors_total`` counter).
#: not_supported and function_not_found are asked once; nvml_error and exception are retried every sample.
REASON_NOT_SUPPORTED = "not_supported"  # NOT_SUPPORTED, ARGUMENT_VERSION_MISMATCH, DEPRECATED from the driver
REASON_NO_DATA = "no_data"  # NO_DATA, NOT_READY: nothing to read this time (asked again, logged at debug)
REASON_FUNCTION_NOT_FOUND = "function_not_found"  # symbol missing in the library, or wrapper missing in pynvml
REASON_NVML_ERROR = "nvml_error"  # any other NVML return code (timeout, unknown, ...)
REASON_EXCEPTION = "exception"  # anything else a call raised
FIELD_ERROR_REASONS = (REASON_NOT_SUPPORTED, REASON_FUNCTION_NOT_FOUND, REASON_NVML_ERROR, REASON_EXCEPTION)
_ASKED_ONCE = {REASON_NOT_SUPPORTED, REASON_FUNCTION_NOT_FOUND}

#: One way to make a call: the pynvml function (or its name, looked up at call time so that a pynvml
#: without it is "function not found", not a crash) followed by its arguments.
Variant = tuple[Any, ...]

_INIT_ADVICE = {
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "driver_not_loaded",
        "the NVIDIA kernel driver is not loaded: check `nvidia-smi`; in a container, run with the NVIDIA "
        "container runtime (NVIDIA_DRIVER_CAPABILITIES=utility) or mount the driver",
    ),
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "library_not_found",
        "libnvidia-ml.so.1 was not found: install the NVIDIA driver, or point --nvml.library at the "
        "library (containers: it is usually under /usr/lib/x86_64-linux-gnu or /usr/local/nvidia/lib64)",
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "no_permission",
        "no permission to open the NVIDIA device files (/dev/nvidia*): run as a user in the group that owns "
        "them, or with the device files mounted",
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "driver_library_mismatch",
        "libnvidia-ml does not match the loaded kernel driver (driver upgraded without reboot?): reboot, "
        "or reload the nvidia kernel modules",
    ),
}


def decode(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def load_library(path: str | None) -> None:
    """Load libnvidia-ml from ``path`` (``--nvml.library``) instead of the dynamic linker's choice.

    pynvml loads the library lazily into its module global ``nvmlLib`` under ``libLoadLock``; loading it
    ourselves first is the documented-by-source way to choose the file.
    """
    if path is None:
        return
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is not None:
            return
        try:
            pynvml.nvmlLib = ctypes.CDLL(path)
        except OSError as exc:
            raise NVMLUnavailable(
                f"cannot load NVML library {path!r} given by --nvml.library: {exc}", reason="library_not_found"
            ) from None


def init() -> None:
    """``nvmlInit``; raises ``NVMLUnavailable`` with the reason label and what to do about it."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        reason, advice = _INIT_ADVICE.get(code, ("init_failed", f"nvmlInit failed: {exc}"))
        raise NVMLUnavailable(f"NVML unavailable: {advice}", reason=reason) from None


class NVMLCalls:
    """Per-GPU, per-field isolated NVML calls, with the count of readings lost. Thread-safe counts (the
    sampler and the power-sampler threads both read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the error counts
        self._handles: dict[int, Any] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._variant: dict[tuple[int, str], int] = {}
        self._errors: dict[tuple[int, str, str], int] = {}
        self._logged: set[tuple[int, str]] = set()
        self._costs: dict[str, list[float]] = {}  # NVML function -> [calls, CPU seconds], under _lock

    def timed(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, its calls and the calling thread's CPU time counted under the NVML function's name
        (also when it raises: a failed call costs the driver too)."""
        return self._timed(_name(fn), fn, args)

    def _timed(self, name: str, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``timed`` with the function's name already known (``get`` runs for every reading of every GPU at
        every sample: the name is not worked out again each time)."""
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent = time.thread_time() - t0
            with self._lock:
                cost = self._costs.get(name)
                if cost is None:
                    self._costs[name] = [1.0, spent]
                else:
                    cost[0] += 1.0
                    cost[1] += spent

    def call_costs(self) -> dict[str, tuple[int, float]]:
        """What the NVML calls cost so far: ``function -> (calls, CPU seconds)`` (a copy)."""
        with self._lock:
            return {name: (int(n), s) for name, (n, s) in self._costs.items()}

    def unsupported(self, index: int, what: str) -> bool:
        """The driver said (once) that GPU ``index`` has no ``what``: it is not asked again."""
        return (index, what) in self._unsupported

    @staticmethod
    def call_global(default: Any, *names: str) -> Any:
        """A driver-wide getter, trying ``names`` in turn; ``default`` when none answers."""
        for name in names:
            fn = getattr(pynvml, name, None)
            if fn is None:
                continue
            try:
                value = fn()
            except Exception as exc:  # noqa: BLE001 - a version string is never worth failing for
                log.debug("%s failed: %s: %s", name, type(exc).__name__, exc)
                continue
            return decode(value) if isinstance(value, bytes | str) else value
        return default

    def field_errors(self) -> dict[tuple[int, str, str], int]:
        """Failed readings so far: ``(gpu index, field, reason) -> count`` (a copy)."""
        with self._lock:
            return dict(self._errors)

    def classify(self, index: int, what: str, exc: BaseException) -> str:
        """The reason label for ``exc``; raises ``GPULost`` when it says the GPU is gone."""
        if isinstance(exc, pynvml.NVMLLibraryMismatchError):
            return REASON_FUNCTION_NOT_FOUND
        if isinstance(exc, pynvml.NVMLError):
            code = getattr(exc, "value", None)
            if code in _LOST:
                raise GPULost(
                    f"GPU {index} is lost ({exc}) while reading {what}: check `nvidia-smi` and the kernel log "
                    "(Xid errors); the GPU may need a reset or the node a reboot"
                ) from None
            if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                return REASON_FUNCTION_NOT_FOUND
            return self.reason_of_code(code)
        return REASON_EXCEPTION

    @staticmethod
    def reason_of_code(code: Any) -> str:
        if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            return REASON_FUNCTION_NOT_FOUND
        if code in _NO_DATA:
            return REASON_NOT_SUPPORTED
        if code in _NOT_NOW:
            return REASON_NO_DATA
        return REASON_NVML_ERROR

    def lose(self, index: int, what: str, reason: str, detail: str) -> None:
        """Count and log (once per GPU and field) a reading that could not be had."""
        key = (index, what)
        with self._lock:
            self._errors[(index, what, reason)] = self._errors.get((index, what, reason), 0) + 1
        if reason in _ASKED_ONCE:
            self._unsupported.add(key)
            log.debug("GPU %d: %s not available (%s); not asking again", index, what, detail)
            return
        if reason == REASON_NO_DATA:
            log.debug("GPU %d: %s has no data this time (%s)", index, what, detail)
            return
        if key in self._logged:
            log.debug("GPU %d: reading %s failed again: %s", index, what, detail)
            return
        self._logged.add(key)
        log.warning(
            "GPU %d: reading %s failed (%s); this reading is left out while it fails, every other reading "
            "goes on (counted in gpuenergy_nvml_field_errors_total; if it persists, check `nvidia-smi -q` "
            "and the kernel log)", index, what, detail,
        )

    def get(self, index: int, what: str, *variants: Variant) -> Any:
        """Read one field of GPU ``index``: the first variant that answers (newest first), else None.

        A variant whose function is missing (``function_not_found``) or that does not support the reading is
        skipped for the next one; the variant that answered is remembered. Any other failure loses this
        field for this sample only. Raises only ``GPULost``.
        """
        key = (index, what)
        if key in self._unsupported:
            return None
        reason, detail = REASON_EXCEPTION, "no variant"
        answered = self._variant.get(key)
        for k in range(answered or 0, len(variants)):
            variant = variants[k]
            named = variant[0]
            if isinstance(named, str):
                fn, name = getattr(pynvml, named, None), named
            else:
                fn, name = named, _name(named)
            if fn is None:
                reason, detail = REASON_FUNCTION_NOT_FOUND, f"the installed pynvml has no {named}"
            else:
                try:
                    value = self._timed(name, fn, variant[1:])
                except Exception as exc:  # noqa: BLE001 - one call never takes more than its own reading
                    reason = self.classify(index, what, exc)
                    detail = f"{_name(named)}: {type(exc).__name__}: {exc}"
                else:
                    if answered != k:
                        self._variant[key] = k
                        if k:
                            log.debug("GPU %d: %s read with %s (the newer variants are missing)", index, what,
                                      _name(named))
                    return value
            if reason not in _ASKED_ONCE:
                break  # a real failure: the older variant would not fix it
            if k + 1 < len(variants):
                log.debug("GPU %d: %s: %s; trying the next variant", index, what, detail)
        self.lose(index, what, reason, detail)
        return None

    def field(self, index: int, what: str, fn: Callable[..., T] | str, *args: Any) -> T | None:
        """One NVML getter for GPU ``index`` (no fallback); None when it cannot be read."""
        value: T | None = self.get(index, what, (fn, *args))
        return value

    def handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as exc:
                if getattr(exc, "value", None) in _LOST | {pynvml.NVML_ERROR_INVALID_ARGUMENT}:
                    raise GPULost(f"GPU {index} cannot be opened ({exc})") from None
                raise
            self._handles[index] = handle
        return handle

    def field_values(self, index: int, h: Any, ids: list[Any], names: dict[tuple[Any, ...], str],
                     request: FieldValues | None = None) -> list[float | None]:
        """Read several field values in one call; per-field failures are None. ``request``: the same ``ids``
        as a ``FieldValues`` kept by the caller (asked every sample), instead of pynvml's wrapper."""
        values = (self.field(index, "field_values", "nvmlDeviceGetFieldValues", h, ids) if request is None
                  else self.field(index, "field_values", request, h))
        if values is None:
            return [None] * len(ids)
        out: list[float | None] = []
        for want, v in zip(ids, values, strict=False):
            if v.nvmlReturn != pynvml.NVML_SUCCESS:
                if v.nvmlReturn in _LOST:
                    raise GPULost(f"GPU {index} is lost (field {v.fieldId})")
                what = names.get(tuple(want), f"field {v.fieldId}")
                if (index, what) not in self._unsupported:
                    # Per field, as for a whole call: "not supported" is remembered, anything else (a
                    # transient error) loses this field for this sample only.
                    self.lose(index, what, self.reason_of_code(v.nvmlReturn), f"NVML return code {v.nvmlReturn}")
                out.append(None)
                continue
            out.append(field_value(v))
        return out


def _name(fn: Any) -> str:
    if isinstance(fn, str):
        return fn
    return str(getattr(fn, "nvml_function", None) or getattr(fn, "__name__", repr(fn)))


class _FieldValue(ctypes.Structure):
    """``nvmlFieldValue_t`` (pynvml's layout), read without pynvml's Python-level attribute hooks."""

    _fields_ = pynvml.c_nvmlFieldValue_t._fields_


class FieldValues:
    """``nvmlDeviceGetFieldValues`` for a list of ``(field id, scope)`` asked at every sample of one GPU: the
    array is built once, and before each call reset to what pynvml's wrapper builds anew (the ids, every
    output zero), so the driver sees the same request and the answer is read the same way, without a
    Python-level hook per field read or written. One caller thread per instance (the array is reused)."""

    def __init__(self, ids: list[tuple[int, int]], clock: Callable[[], float] = time.time) -> None:
        self.__name__ = "nvmlDeviceGetFieldValues"  # what NVMLCalls names in its messages
        self._clock = clock
        #: when the last call read its fields (wall clock; see ``read_time``); None before a call answered
        self.read_at: float | None = None
        self._template = (_FieldValue * len(ids))()
        for v, (field_id, scope) in zip(self._template, ids, strict=True):
            v.fieldId, v.scopeId = field_id, scope
        self._values = (_FieldValue * len(ids))()
        self._size = ctypes.sizeof(self._values)
        self._count = ctypes.c_int32(len(ids))

    def __call__(self, h: Any) -> Any:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")  # noqa: SLF001 - as pynvml's wrapper
        ctypes.memmove(self._values, self._template, self._size)
        self.read_at = None
        before = self._clock()
        ret = fn(h, self._count, ctypes.byref(self._values))
        after = self._clock()
        pynvml._nvmlCheckReturn(ret)  # noqa: SLF001
        self.read_at = read_time(self._values, before, after)
        return self._values


def read_time(values: Any, before: float, after: float) -> float:
    """When a batched field read happened, by the driver's clock: the timestamp of its first answered field
    (microseconds since 1970); without one, the midpoint of ``before``..``after``, the clock around the
    call itself (not before the Python work that leads to it: on a loaded machine a thread can wait tenths
    of a second for the GIL between the two). The caller holds it within its own read
    (``collectors.gpu_tracks.reading_time``): a driver's clock may not be the exporter's."""
    for v in values:
        if v.nvmlReturn == pynvml.NVML_SUCCESS and v.timestamp > 0:
            return float(v.timestamp * 1e-6)
    return 0.5 * (before + after)


class _ProcessInfo(ctypes.Structure):
    """``nvmlProcessInfo_t`` of the ``_v2`` and ``_v3`` process lists (one layout), read without pynvml's
    Python-level attribute hooks."""

    _fields_ = pynvml.c_nvmlProcessInfo_v2_t._fields_


class ProcessInfo(NamedTuple):
    """One entry of the running-process list, as pynvml's list gives it (``usedGpuMemory`` None where the
    driver does not know it)."""

    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's name
    #: the MIG GPU / compute instance the process runs on (0xFFFFFFFF: none, the whole GPU)
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


class RunningProcesses:
    """``nvmlDeviceGetComputeRunningProcesses_v3`` (or ``_v2``) for one GPU in one NVML call per sample.

    pynvml's wrapper makes two: the first, without a buffer, only asks how many processes there are. This
    keeps a buffer per GPU sized from the last answer plus headroom (twice the count plus 5, as pynvml
    sizes it) and passes it at once; only when the list outgrew it (``NVML_ERROR_INSUFFICIENT_SIZE``, with
    the count needed) is it resized and the call made again: pynvml's two-call form. A symbol the library
    lacks raises ``NVMLError_FunctionNotFound`` as pynvml's wrappers do, so ``NVMLCalls.get`` falls back
    to the older variant the same way. Called from the sampler thread only (the buffer is reused)."""

    def __init__(self, symbol: str) -> None:
        self.__name__ = symbol  # what NVMLCalls names in its messages
        self._symbol = symbol
        self._capacity = 0
        self._buffer: Any = None  # an array of _ProcessInfo, or None (the count-only call)

    def __call__(self, h: Any) -> list[ProcessInfo]:
        fn = pynvml._nvmlGetFunctionPointer(self._symbol)  # noqa: SLF001 - raises FunctionNotFound if missing
        count = ctypes.c_uint(self._capacity)
        ret = fn(h, ctypes.byref(count), self._buffer)
        if ret == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            self._capacity = count.value * 2 + 5
            self._buffer = (_ProcessInfo * self._capacity)()
            count = ctypes.c_uint(self._capacity)
            ret = fn(h, ctypes.byref(count), self._buffer)
        pynvml._nvmlCheckReturn(ret)  # noqa: SLF001 - pynvml's own error classes, as its wrappers raise
        n = min(count.value, self._capacity)
        if not n:  # also the count-only call answering success: no process
            return []
        na = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
        return [ProcessInfo(p.pid, None if p.usedGpuMemory == na else p.usedGpuMemory, p.gpuInstanceId,
                            p.computeInstanceId)
                for p in self._buffer[:n]]


def process_utilization(h: Any, last_seen: int) -> Any:
    try:
        return pynvml.nvmlDeviceGetProcessUtilization(h, last_seen)
    except pynvml.NVMLError as exc:
        # NOT_FOUND: no process ran since last_seen; that is an empty list, not "unsupported".
        if getattr(exc, "value", None) == pynvml.NVML_ERROR_NOT_FOUND:
            return []
        raise


process_utilization.nvml_function = "nvmlDeviceGetProcessUtilization"  # type: ignore[attr-defined]


def field_value(v: Any) -> float | None:
    """Decode an nvmlFieldValue_t union by its valueType."""
    t = v.valueType
    u = v.value
    if t == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(u.dVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return float(u.uiVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(u.ulVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(u.ullVal)
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(u.sllVal)
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return float(u.siVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return float(u.usVal)
    return None


