"""The ``host`` collector: whole-host CPU utilisation and memory (psutil).

CPU utilisation is computed from the difference of ``psutil.cpu_times()`` between two updates, so it
covers exactly the collector interval and never blocks (``psutil.cpu_percent(interval=...)`` sleeps, and
its no-interval form keeps hidden global state shared with every other caller in the process). The
memory figures feed the "host RAM about to run out" alert and the terminal view; the critical threshold
is exposed as a gauge so both use the same number.

``--path.procfs`` (a host's /proc mounted elsewhere, as in the DaemonSet) reaches psutil through its one
process-wide setting, ``psutil.PROCFS_PATH``: the host collector is psutil's only user in the exporter, and
the exporter's own ``process_*`` series keep reading ``/proc/self``.

Runs on the sampler thread; never called at scrape time. Reads no GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import psutil
from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.collectors.registry import CollectorSpec, Wiring, register
from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.flagtypes import Flag, positive_int

log = logging.getLogger(__name__)

NAME = "host"

#: Default "host RAM is critically low" threshold: available memory under 1 GiB.
DEFAULT_MEMORY_CRITICAL_BYTES = 1 << 30

CPU_UTILIZATION = metrics.define(
    "host", "cpu_utilization_ratio", "gauge",
    "Fraction of the host's CPU time (all logical CPUs) spent busy, i.e. not idle or in iowait, over the "
    "last collector interval (0..1).",
    collector=NAME, unit="ratio",
)
# Not "cpu_count": a _count suffix is reserved for histograms and summaries (promtool check metrics).
CPU_COUNT = metrics.define(
    "host", "logical_cpus", "gauge", "Number of logical CPUs of the host.", collector=NAME,
)
MEMORY_TOTAL = metrics.define(
    "host", "memory_total_bytes", "gauge", "Total physical memory of the host.", collector=NAME, unit="bytes",
)
MEMORY_AVAILABLE = metrics.define(
    "host", "memory_available_bytes", "gauge",
    "Memory that can be given to processes without swapping (MemAvailable). Alert when it falls below "
    "gpuenergy_host_memory_critical_bytes.",
    collector=NAME, unit="bytes",
)
MEMORY_USED = metrics.define(
    "host", "memory_used_bytes", "gauge",
    "Memory in use as psutil reports it (total - free - buffers - cache on Linux).",
    collector=NAME, unit="bytes",
)
MEMORY_CRITICAL = metrics.define(
    "host", "memory_critical_bytes", "gauge",
    "Configured threshold: host RAM is critically low when gpuenergy_host_memory_available_bytes is "
    "below it (used by the alert rules and the terminal view).",
    collector=NAME, unit="bytes",
)
SWAP_TOTAL = metrics.define(
    "host", "swap_total_bytes", "gauge", "Total swap space of the host.", collector=NAME, unit="bytes",
)
SWAP_USED = metrics.define(
    "host", "swap_used_bytes", "gauge", "Swap space in use.", collector=NAME, unit="bytes",
)

# Linux accounts guest time inside user/nice already; psutil.cpu_percent subtracts it the same way.
_NOT_IN_TOTAL = ("guest", "guest_nice")
_IDLE = ("idle", "iowait")


def _busy_and_total(times: Any) -> tuple[float, float]:
    fields = times._asdict()
    total = sum(v for k, v in fields.items() if k not in _NOT_IN_TOTAL)
    idle = sum(fields.get(k, 0.0) for k in _IDLE)
    return total - idle, total


class Swap(NamedTuple):
    total: int
    used: int


_MEMINFO_WANTED = frozenset((b"MemTotal:", b"MemFree:", b"MemAvailable:", b"SwapTotal:", b"SwapFree:"))


def _meminfo() -> dict[bytes, int]:
    """The /proc/meminfo lines this collector uses (under ``psutil.PROCFS_PATH``), in bytes; empty when it
    cannot be read."""
    lines: dict[bytes, int] = {}
    try:
        with open(f"{psutil.PROCFS_PATH}/meminfo", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] in _MEMINFO_WANTED:
                    lines[parts[0]] = int(parts[1]) * 1024
    except (OSError, ValueError):
        return {}
    return lines


def _swap_of(lines: dict[bytes, int]) -> Swap | None:
    if b"SwapTotal:" not in lines or b"SwapFree:" not in lines:
        return None
    return Swap(lines[b"SwapTotal:"], lines[b"SwapTotal:"] - lines[b"SwapFree:"])


def swap_memory() -> Any:
    """Swap total and used in bytes as ``psutil.swap_memory`` reports them (``SwapTotal`` and ``SwapTotal -
    SwapFree`` of /proc/meminfo, under ``psutil.PROCFS_PATH``), without the /proc/vmstat read psutil adds for
    pages swapped in and out, which nothing here uses: that read was half of this collector's CPU every
    sample. Where meminfo lacks the swap lines (or cannot be read), psutil's own answer."""
    swap = _swap_of(_meminfo())
    return swap if swap is not None else psutil.swap_memory()


class VirtualMemory(NamedTuple):
    total: int
    available: int
    used: int


class Meminfo:
    """``virtual_memory`` and ``swap_memory`` as psutil reports them (``MemTotal``; ``MemAvailable``, held
    within 0..total as psutil holds it; used = total - available; ``SwapTotal`` and ``SwapTotal - SwapFree``)
    from ONE read of /proc/meminfo (under ``psutil.PROCFS_PATH``) per sample: ``virtual_memory`` reads it,
    and the ``swap_memory`` that follows answers from that read. psutil's two functions read it twice, its
    ``swap_memory`` /proc/vmstat too. Where meminfo lacks a line this needs (MemAvailable before Linux 3.14,
    or 0), psutil's own answer for that part."""

    def __init__(self) -> None:
        self._swap: Swap | None = None

    def virtual_memory(self) -> Any:
        lines = _meminfo()
        self._swap = _swap_of(lines)
        total, avail = lines.get(b"MemTotal:"), lines.get(b"MemAvailable:")
        if total is None or not avail:
            return psutil.virtual_memory()
        if avail > total:
            avail = lines.get(b"MemFree:", total)
        return VirtualMemory(total, avail, total - avail)

    def swap_memory(self) -> Any:
        swap, self._swap = self._swap, None
        return swap if swap is not None else swap_memory()


class HostCollector(Collector):
    """Host CPU and memory. Every psutil call comes in through the constructor (tests pass their own)."""

    name = NAME
    never_blocks = True  # /proc or /sys reads only

    def __init__(
        self,
        *,
        memory_critical_bytes: int = DEFAULT_MEMORY_CRITICAL_BYTES,
        procfs: str | None = None,
        cpu_times: Callable[[], Any] = psutil.cpu_times,
        cpu_count: Callable[[], int | None] = psutil.cpu_count,
        virtual_memory: Callable[[], Any] | None = None,
        swap_memory: Callable[[], Any] | None = None,
    ) -> None:
        """``virtual_memory`` and ``swap_memory``: psutil's answers (by default one read of /proc/meminfo for
        both, ``Meminfo``)."""
        if memory_critical_bytes < 0:
            raise ValueError("memory_critical_bytes must be zero or positive")
        self._critical = memory_critical_bytes
        if procfs is not None:
            psutil.PROCFS_PATH = procfs  # read at every call by psutil's Linux functions
        self._cpu_times = cpu_times
        self._cpu_count = cpu_count
        meminfo = Meminfo()
        self._virtual_memory = virtual_memory or meminfo.virtual_memory
        self._swap_memory = swap_memory or meminfo.swap_memory
        self._prev: tuple[float, float] | None = None
        self._utilization: float | None = None
        self._low = False

    def _update_utilization(self) -> float | None:
        busy, total = _busy_and_total(self._cpu_times())
        prev, self._prev = self._prev, (busy, total)
        if prev is None:
            return None  # the first update has nothing to difference against
        d_busy, d_total = busy - prev[0], total - prev[1]
        if d_total <= 0:
            # No tick elapsed (updates closer than the kernel's accounting step): keep the last value.
            self._prev = prev
            return self._utilization
        # Counters can step back slightly (CPU hot-unplug, some VMs); clamp instead of exposing < 0 or > 1.
        self._utilization = min(1.0, max(0.0, d_busy / d_total))
        return self._utilization

    def update(self) -> list[Metric]:
        out: list[Metric] = []
        utilization = self._update_utilization()
        if utilization is not None:
            fam = CPU_UTILIZATION.family()
            metrics.add(fam, (), utilization)
            out.append(fam)
        count = self._cpu_count()
        if count:
            fam = CPU_COUNT.family()
            metrics.add(fam, (), count)
            out.append(fam)

        vm = self._virtual_memory()
        for spec, value in (
            (MEMORY_TOTAL, vm.total),
            (MEMORY_AVAILABLE, vm.available),
            (MEMORY_USED, vm.used),
            (MEMORY_CRITICAL, self._critical),
        ):
            fam = spec.family()
            metrics.add(fam, (), value)
            out.append(fam)
        self._log_transition(vm.available)

        sm = self._swap_memory()
        for spec, value in ((SWAP_TOTAL, sm.total), (SWAP_USED, sm.used)):
            fam = spec.family()
            metrics.add(fam, (), value)
            out.append(fam)
        return out

    def _log_transition(self, available: int) -> None:
        # Once per crossing, not once per update: the gauge and the alert carry the ongoing state.
        low = available < self._critical
        if low and not self._low:
            log.warning(
                "host RAM is critically low: %.2f GiB available, below the %.2f GiB threshold; "
                "training processes risk being killed by the out-of-memory killer",
                available / (1 << 30), self._critical / (1 << 30),
            )
        elif self._low and not low:
            log.info("host RAM recovered: %.2f GiB available", available / (1 << 30))
        self._low = low


def _build(w: Wiring) -> HostCollector:
    return HostCollector(memory_critical_bytes=w.config.host_memory_critical, procfs=w.config.path_procfs)


register(CollectorSpec(
    NAME, True, "Host CPU utilisation and memory (psutil).", order=10, build=_build, title="Host (collector `host`)",
    flags=(Flag("host.memory-critical", positive_int, str(1 << 30),
                "Host available memory under which the exporter warns (log, alert, terminal view).", "BYTES"),),
))
