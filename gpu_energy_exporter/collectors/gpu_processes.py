"""The processes NVML lists on each GPU, made usable for attribution: who they are on the host, and how much
of the GPU's SMs each used.

Two jobs, both on the sampler thread, for the GPU collector:

- ``ProcessTable`` looks each listed pid up in the host's process table (``--path.procfs``): its ``NSpid``
  line (the pid inside its container) and its cgroup (container id, pod UID), with ``core.procinfo``. NVML
  lists host pids; an exporter that does not see the host's processes (a container without ``hostPID`` or
  the host's ``/proc`` mounted) finds none of them, and the process then carries no host identity: the
  ledger and pod attribution fall back to the claims alone and say so. Looked up once per pid while NVML
  keeps listing it (procfs is memory, not disk; a pid no longer listed is forgotten).
- ``UtilizationCadence`` decides when a GPU is asked for per-process SM utilisation
  (``nvmlDeviceGetProcessUtilization`` costs 1.6-2.6 ms of CPU per call on a real H100, against
  microseconds for the process list): with every read of the GPU's energy counter (the samples since the
  last ask split the span that read settles, ``core.settle``) and every ``--collector.gpu.process-interval``
  between, and only for a GPU that lists two processes or more (a lone process gets the whole GPU whatever it
  uses). Between reads, each process keeps the weight last measured (the provisional split).

Never calls NVML itself and never touches anything under procfs but ``<pid>/status``, ``<pid>/cgroup`` and
(``ProcfsPods``) ``<pid>/environ``; each is opened non-blocking and read only if it is a regular file, and
``environ`` (whose read takes the process's memory lock) off the collector's thread with a timeout.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from gpu_energy_exporter.collectors.kubernetes.assignments import PodRef
from gpu_energy_exporter.core.procinfo import ProcessIdentity, parse_cgroup, parse_nspid
from gpu_energy_exporter.core.state import GPUReading
from gpu_energy_exporter.core.tenantfiles import Stuck, TooLarge, Watchdog, read_regular

#: Pids remembered per table at most (a node lists far fewer compute processes).
_MAX_PIDS = 4096


def _read_proc(path: str) -> str:
    """A procfs text file, non-blocking and regular (``core.tenantfiles``: --path.procfs may point anywhere)."""
    return read_regular(path, 16384).decode("utf-8", "replace")


def _read_environ(path: str) -> bytes:
    """The first 64 KiB of a process's environment (its start holds HOSTNAME; more is not needed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


class ProcessTable:
    """Host identities of pids, read under ``procfs`` (None: no lookup; every process stays unknown)."""

    def __init__(self, procfs: str | None) -> None:
        self._procfs = procfs
        self._known: dict[int, ProcessIdentity | None] = {}

    def identify(self, pid: int) -> ProcessIdentity | None:
        if self._procfs is None or pid <= 0:
            return None
        if pid in self._known:
            return self._known[pid]
        found = self._read(pid)
        if len(self._known) >= _MAX_PIDS:
            self._known.clear()
        self._known[pid] = found
        return found

    def _read(self, pid: int) -> ProcessIdentity | None:
        assert self._procfs is not None
        base = os.path.join(self._procfs, str(pid))
        try:
            status = _read_proc(os.path.join(base, "status"))
        except (OSError, TooLarge):
            return None  # not visible here (no host pid namespace), gone, or not procfs's
        try:
            cgroup = _read_proc(os.path.join(base, "cgroup"))
        except (OSError, TooLarge):
            cgroup = ""
        pod, container = parse_cgroup(cgroup)
        return ProcessIdentity(pid, parse_nspid(status), container, pod)

    def forget_except(self, listed: set[int]) -> None:
        """Drop pids NVML no longer lists (a pid reused later is looked up afresh)."""
        for pid in [p for p in self._known if p not in listed]:
            del self._known[pid]


class UtilizationCadence:
    """When to ask a GPU for per-process SM utilisation, and the weights that hold between two asks."""

    def __init__(self, interval_s: float, monotonic: Callable[[], float]) -> None:
        self._interval = interval_s
        self._monotonic = monotonic
        self._last: dict[int, float] = {}  # GPU index -> monotonic time of the last ask
        self._weights: dict[int, dict[int, float]] = {}  # GPU index -> pid -> SM %

    def due(self, index: int, processes: int, *, with_counter: bool = False) -> bool:
        """Whether GPU ``index``, listing ``processes`` processes last time, should be asked now:
        ``with_counter``, its energy counter is read in this sample (the samples since the last ask then
        settle the span that read closes: ``core.settle``), or ``interval`` has passed since the last ask."""
        if self._interval <= 0 or processes < 2:
            return False
        if with_counter:
            return True
        last = self._last.get(index)
        return last is None or self._monotonic() - last >= self._interval

    def asked(self, index: int) -> None:
        self._last[index] = self._monotonic()

    def apply(self, index: int, reading: GPUReading, table: ProcessTable, asked: bool) -> GPUReading:
        """The reading with each process's host identity and its SM weight (measured now when ``asked``,
        else the last one measured for that pid)."""
        procs = reading.processes
        if procs is None:
            return reading
        if not procs:  # nothing runs: no identity or weight to add (this runs for every GPU at every sample)
            self._weights.pop(index, None)
            return reading
        weights = self._weights.setdefault(index, {})
        if asked and all(p.sm_util_pct is None for p in procs):
            # NOT_FOUND: the driver took no sample since the last ask (asked again within its sampling period,
            # 1/6 s to 1 s): nothing was measured, so the last weights hold, as between asks. (Read as "no
            # weight", it split the GPU evenly for that sample: +7% for a trainer at 10% of the SMs.)
            asked = False
        if asked:
            weights.clear()
            weights.update({p.pid: p.sm_util_pct for p in procs if p.sm_util_pct is not None})
        listed = {p.pid for p in procs}
        for pid in [p for p in weights if p not in listed]:
            del weights[pid]
        out = tuple(
            replace(p, sm_util_pct=p.sm_util_pct if asked else weights.get(p.pid), host=table.identify(p.pid))
            for p in procs
        )
        return replace(reading, processes=out)


class ProcfsPods:
    """``pid_to_pod`` for the kubernetes collector: the container (one of the GPU's holders) that runs a host
    pid, found from the process's ``HOSTNAME`` (the kubelet sets it to the pod's name unless the pod sets
    ``spec.hostname``) in ``<procfs>/<pid>/environ``. The kubelet's pod-resources API names pods, not their
    UIDs, so the cgroup's pod UID cannot be joined to it. Reading another process's environment needs the
    host's pid namespace (``hostPID``) or the host's /proc, and root (docs/deploy.md says what that grants). A
    process can only name a pod holding the same GPU (``candidates``); one that names none, or a pod with
    several holding containers, is not resolved (the GPU is then split evenly)."""

    #: A pid's answer is read again after this long (a pid reused by another pod's process is found).
    TTL_S = 60.0

    def __init__(self, procfs: str, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._procfs = procfs
        self._monotonic = monotonic
        self._names: dict[int, tuple[str, float]] = {}
        self._watchdog = Watchdog("procfs-environ", 0.5)

    def hostname(self, pid: int) -> str:
        now = self._monotonic()
        cached = self._names.get(pid)
        name = cached[0] if cached is not None and now - cached[1] < self.TTL_S else None
        if name is None:
            name = ""
            try:
                # Reading another process's environment takes its memory lock, which that process can hold:
                # off this thread, waited for a moment at most (a stuck read leaves the pid unresolved)
                environ = self._watchdog.call(_read_environ, os.path.join(self._procfs, str(pid), "environ"))
            except (OSError, Stuck):
                environ = b""  # not visible (no host pid namespace), gone, not permitted or stuck: unresolved
            for item in environ.split(b"\0"):
                if item.startswith(b"HOSTNAME="):
                    name = item[9:].decode("utf-8", "replace")
                    break
            if len(self._names) >= _MAX_PIDS:
                self._names.clear()
            self._names[pid] = (name, now)
        return name

    def __call__(self, pid: int, candidates: Sequence[PodRef]) -> PodRef | None:
        name = self.hostname(pid)
        found = [c for c in candidates if name and c.pod == name]
        return found[0] if len(found) == 1 else None
