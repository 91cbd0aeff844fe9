"""The exporter's own ``gpuenergy_process_*`` series on the scrape path, encoded directly.

``ProcessExposition.render(openmetrics)`` gives the bytes ``prometheus_client``'s ``ProcessCollector``
(namespace ``gpuenergy``) would give, families, names, help texts and values alike (the same reads of
``/proc/<pid>/stat``, ``/proc/<pid>/limits`` and ``/proc/<pid>/fd`` and the same arithmetic), with two
savings: the text around the values is built once, and the values are read at most once per ``max_age``
(1 s by default): scrapes less than a second apart serve the same reading (docs/metrics.md says so). A
scrape after a busy second pays 0.1 to 0.2 ms for those reads (``/proc/<pid>/stat`` sums every thread).

The headers and sample heads come from one ``ProcessCollector`` encoded at start-up, so they cannot drift
from prometheus_client's. This module never samples a GPU and never takes a lock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector

from gpu_energy_exporter.core import encoder

_NAMES = ("virtual_memory_bytes", "resident_memory_bytes", "start_time_seconds", "cpu_seconds_total",
          "open_fds", "max_fds")


class ProcessExposition:
    """``ProcessCollector(namespace=...)``'s families as bytes, with the values read at every render."""

    def __init__(self, namespace: str = "gpuenergy", *, pid: Callable[[], int | str] = lambda: "self",
                 proc: str = "/proc", max_age: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.collector = ProcessCollector(namespace=namespace, pid=pid, proc=proc, registry=None)
        self._pid = pid
        self._proc = proc
        self._prefix = namespace + "_process_" if namespace else "process_"
        self._ticks = self.collector._ticks
        self._pagesize = self.collector._pagesize
        self._btime = self.collector._btime
        # per format: {short name: (header, sample head)} taken from prometheus_client's own encoding
        self._parts: dict[bool, dict[str, tuple[bytes, bytes]]] = {}
        self._max_age = max_age
        self._clock = clock
        self._rendered: dict[bool, tuple[float, bytes]] = {}  # format -> (when read, bytes)

    def collect(self) -> list[Metric]:
        """prometheus_client's families (what ``render`` encodes)."""
        return list(self.collector.collect())

    def _text(self, openmetrics: bool) -> dict[str, tuple[bytes, bytes]]:
        parts = self._parts.get(openmetrics)
        if parts is None:
            parts = {}
            for fam in self.collector.collect():
                sample = fam.samples[0]
                head = encoder.sample_head(sample.name, tuple(sample.labels.items()), openmetrics)
                parts[sample.name.removeprefix(self._prefix)] = (encoder.header(fam, openmetrics), head)
            self._parts[openmetrics] = parts
        return parts

    def values(self) -> list[tuple[str, float]]:
        """(short name, value) in prometheus_client's order, read now; a file that cannot be read leaves out
        its families, as prometheus_client does."""
        if not self._btime:
            return []
        pid = os.path.join(self._proc, str(self._pid()).strip())
        out: list[tuple[str, float]] = []
        try:
            with open(os.path.join(pid, "stat"), "rb") as stat:
                parts = stat.read().split(b")")[-1].split()
            ticks = self._ticks
            out += [("virtual_memory_bytes", float(parts[20])),
                    ("resident_memory_bytes", float(parts[21]) * self._pagesize),
                    ("start_time_seconds", float(parts[19]) / ticks + self._btime),
                    ("cpu_seconds_total", float(parts[11]) / ticks + float(parts[12]) / ticks)]
        except OSError:
            pass
        try:
            max_fds = None
            with open(os.path.join(pid, "limits"), "rb") as limits:
                for line in limits:
                    if line.startswith(b"Max open file"):
                        max_fds = float(line.split()[3])
                        break
            open_fds = float(len(os.listdir(os.path.join(pid, "fd"))))
            if max_fds is not None:
                out += [("open_fds", open_fds), ("max_fds", max_fds)]
        except OSError:
            pass
        return out

    def render(self, openmetrics: bool) -> bytes:
        """The families as bytes (OpenMetrics without ``# EOF``), read again when the last reading in this
        format is ``max_age`` old."""
        now = self._clock()
        hit = self._rendered.get(openmetrics)
        if hit is not None and now - hit[0] < self._max_age:
            return hit[1]
        body = self._render(openmetrics)
        self._rendered[openmetrics] = (now, body)
        return body

    def _render(self, openmetrics: bool) -> bytes:
        values = self.values()
        if not values:
            return b""
        parts = self._text(openmetrics)
        if any(name not in parts for name, _ in values):  # a file unreadable at start-up: encoded the slow way
            return encoder.encode_families(self.collect(), openmetrics)
        out: list[bytes] = []
        for name, value in values:
            header, head = parts[name]
            out += (header, head, encoder.go_float(value).encode("ascii"), b"\n")
        return b"".join(out)


__all__ = ["ProcessExposition"]
