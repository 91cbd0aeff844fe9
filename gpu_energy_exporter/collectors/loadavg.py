"""The ``loadavg`` collector (off by default): the host's run-queue load averages from ``<path.procfs>/loadavg``.

A data loader or tokenizer starved of CPU shows as a GPU waiting: the load average beside the logical CPU
count (``gpuenergy_host_logical_cpus``) says whether the host's CPUs keep up with the training. One small
file read per sample, no dependency. A missing or unreadable file is "no data here", said once in the log.

It is also the smallest example of a collector: this one file declares the metric, the collector and its
registration (``collectors.registry``); the flag, its environment variable, ``--help``, the daemon's wiring
and the docs follow from it.
"""

from __future__ import annotations

import logging
import os

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.collectors.registry import CollectorSpec, Wiring, register
from gpu_energy_exporter.core import metrics

log = logging.getLogger(__name__)

NAME = "loadavg"

LOAD_AVERAGE = metrics.define(
    "host", "load_average", "gauge",
    "The host's run-queue load average (runnable and uninterruptible tasks) over the window, as the kernel "
    "computes it (/proc/loadavg). Compare with gpuenergy_host_logical_cpus.",
    ["window"], collector=NAME,
)
WINDOWS = ("1m", "5m", "15m")


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """The three load averages of a ``/proc/loadavg`` line (``0.52 0.58 0.59 1/389 12345``)."""
    fields = text.split()
    if len(fields) < 3:
        raise ValueError(f"expected three load averages, got {text[:64]!r}")
    one, five, fifteen = (float(f) for f in fields[:3])
    return one, five, fifteen


class LoadAverageCollector(Collector):
    name = NAME
    never_blocks = True  # /proc or /sys reads only

    def __init__(self, *, procfs: str = "/proc") -> None:
        self._path = os.path.join(procfs, "loadavg")
        self._said: str | None = None  # the last problem logged (each one once)

    def update(self) -> list[Metric]:
        try:
            with open(self._path, encoding="ascii", errors="replace") as f:
                values = parse_loadavg(f.read(256))
        except (OSError, ValueError) as exc:
            problem = f"cannot read the load average from {self._path}: {exc}"
            if problem != self._said:
                log.info("%s", problem)
                self._said = problem
            raise NoData(problem) from None
        self._said = None
        fam = LOAD_AVERAGE.family()
        for window, value in zip(WINDOWS, values, strict=True):
            metrics.add(fam, [window], value)
        return [fam]


def _build(w: Wiring) -> LoadAverageCollector:
    return LoadAverageCollector(procfs=w.config.path_procfs)


register(CollectorSpec(
    NAME, False, "Host load averages over 1, 5 and 15 minutes (/proc/loadavg).", order=15, build=_build,
    title="Host load average (collector `loadavg`)",
))
