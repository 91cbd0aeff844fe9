"""The ``rapl`` collector: CPU package / DRAM / platform energy from the Linux powercap (RAPL) tree.

Reads ``<path.sysfs>/class/powercap/intel-rapl:N`` (one top-level zone per package, or ``psys``) and
``intel-rapl:N:M`` (sub-zones: core, uncore, dram). AMD processors expose the same ``intel-rapl`` names
on recent kernels. ``intel-rapl-mmio:*`` zones are skipped: they are the MMIO view of the same package
counter and would double count.

What it must get right, and how:

- Units: ``energy_uj`` is µJ; it is converted to joules once, here. Arithmetic stays in integer µJ.
- Wrap: ``energy_uj`` counts from 0 to ``max_energy_range_uj`` inclusive and then starts again at 0, so a
  reading below the previous one means the counter wrapped and the energy in between is
  ``raw + (max_energy_range_uj + 1) - previous``. (The hardware counts in units of 15-61 µJ, so the true
  modulus is ``max + one unit``; ``max + 1`` under-counts by less than one unit per wrap, a few tens of
  µJ every few minutes at most.) One wrap per interval at most is assumed: at 500 W a 262,143 J range
  lasts about 9 minutes, far longer than any sane ``--collector.interval``.
- Unknown range: when ``max_energy_range_uj`` cannot be read, a decrease is treated as a counter restart
  from 0: the exposed counter rises by the new raw value only (a lower bound: the energy between the
  previous reading and the wrap is lost, never invented) and ``gpuenergy_rapl_resets_total`` counts it.
- Overlap: package contains core and uncore; psys covers the whole platform. Domains are labelled
  (``domain`` and ``scope``), never summed here.
- Permission: since Linux 5.10 ``energy_uj`` is readable by root only (CVE-2020-8694, "PLATYPUS"). A
  permission error is logged once as a warning that says what to do, shows as
  ``gpuenergy_rapl_readable 0`` for the zone, and never fails the collector; other zones keep working.
  To grant access without running as root: give the process CAP_DAC_READ_SEARCH, or a udev rule such as
  ``ACTION=="add", SUBSYSTEM=="powercap", RUN+="/bin/chgrp rapl /sys%p/energy_uj",
  RUN+="/bin/chmod g+r /sys%p/energy_uj"`` plus membership of that group (a world-readable file would
  re-open the side channel to every local user).
- No powercap tree (VMs, containers without /sys, non-x86): no series, one debug log, and
  ``gpuenergy_collector_success{collector="rapl"} 0`` ("had nothing to read", as for every collector).

Runs on the sampler thread, never at scrape time. Touches nothing outside ``<path.sysfs>``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.collectors.registry import CollectorSpec, Wiring, register
from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.flagtypes import Flag, existing_dir

log = logging.getLogger(__name__)

NAME = "rapl"

#: Labels of every per-zone RAPL series.
ZONE_LABELS: tuple[str, ...] = ("zone", "domain", "package", "scope")

#: ``scope`` label: how a domain relates to the others, so that nobody sums overlapping zones.
SCOPE_PACKAGE = "package"  # a whole CPU package (or die on multi-die packages)
SCOPE_PACKAGE_PART = "package_part"  # core / uncore: already included in their package
SCOPE_DRAM = "dram"  # memory attached to the package, not included in the package figure
SCOPE_PLATFORM = "platform"  # psys: the whole SoC/platform, includes the package
SCOPE_UNKNOWN = "unknown"

_SCOPES = {"package": SCOPE_PACKAGE, "core": SCOPE_PACKAGE_PART, "uncore": SCOPE_PACKAGE_PART,
           "dram": SCOPE_DRAM, "psys": SCOPE_PLATFORM}

ENERGY = metrics.define(
    "rapl", "energy_joules_total", "counter",
    "Energy of one RAPL (powercap) zone, kept monotonic across the hardware counter's wrap. Zones "
    "overlap, so summing across domains double counts: core and uncore (scope=\"package_part\") are "
    "part of their package, psys (scope=\"platform\") covers the whole platform. CPU plus memory "
    "energy is the sum of scope=\"package\" and scope=\"dram\" zones.",
    ZONE_LABELS, collector=NAME, unit="joules",
)
READABLE = metrics.define(
    "rapl", "readable", "gauge",
    "1 if the zone's energy counter could be read at the last update, 0 if not (for example permission "
    "denied: energy_uj is root-only since Linux 5.10; see the exporter log for how to grant access).",
    ZONE_LABELS, collector=NAME,
)
WRAPS = metrics.define(
    "rapl", "wraps_total", "counter",
    "Wraps of the zone's energy_uj counter at max_energy_range_uj, corrected exactly.",
    ZONE_LABELS, collector=NAME,
)
RESETS = metrics.define(
    "rapl", "resets_total", "counter",
    "Decreases of the zone's energy_uj counter that could not be corrected because max_energy_range_uj "
    "was unreadable: the energy between the previous reading and the wrap is missing from the total.",
    ZONE_LABELS, collector=NAME,
)

_ZONE_RE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")
_PACKAGE_RE = re.compile(r"^package-(\d+)(?:-die-\d+)?$")


def read_sysfs(path: str) -> str:
    """Read one small sysfs attribute."""
    with open(path, encoding="ascii") as f:
        return f.read(256)


@dataclass
class _Zone:
    labels: tuple[str, str, str, str]
    max_range_uj: int | None = None
    last_raw_uj: int | None = None
    total_uj: int = 0
    wraps: int = 0
    resets: int = 0
    failing: str = ""  # short description of the current read failure, "" while readable
    range_logged: bool = False


class RaplCollector(Collector):
    """RAPL zones under ``<sysfs>/class/powercap``. ``read_text`` reads one sysfs attribute (tests may
    pass their own to simulate errors a root test process cannot provoke with chmod)."""

    name = NAME
    never_blocks = True  # /proc or /sys reads only

    def __init__(self, *, sysfs: str = "/sys", read_text: Callable[[str], str] = read_sysfs) -> None:
        self._root = os.path.join(sysfs, "class", "powercap")
        self._read = read_text
        self._zones: dict[str, _Zone] = {}
        self._absent_logged = False
        self._mmio_logged = False
        self._permission_warned = False

    # -- discovery ------------------------------------------------------------------------------------

    def _zone_dirs(self) -> list[str] | None:
        try:
            entries = os.listdir(self._root)
        except FileNotFoundError:
            self._log_absent(f"{self._root} does not exist (no powercap/RAPL support here)")
            return None
        except OSError as exc:
            self._log_absent(f"cannot list {self._root}: {exc}")
            return None
        if any(e.startswith("intel-rapl-mmio:") for e in entries) and not self._mmio_logged:
            log.debug("RAPL: skipping intel-rapl-mmio zones (they duplicate the intel-rapl package zones)")
            self._mmio_logged = True
        zones = sorted((e for e in entries if _ZONE_RE.match(e)), key=_zone_sort_key)
        if not zones:
            self._log_absent(f"no intel-rapl zones under {self._root}")
        return zones

    def _log_absent(self, why: str) -> None:
        if not self._absent_logged:
            log.debug("RAPL: %s; no RAPL metrics", why)
            self._absent_logged = True

    def _name_of(self, zone: str) -> str | None:
        try:
            return self._read(os.path.join(self._root, zone, "name")).strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def _labels_for(self, zone: str) -> tuple[str, str, str, str]:
        name = self._name_of(zone)
        m = _ZONE_RE.match(zone)
        assert m is not None
        package = ""
        domain = "unknown" if name is None else name.lower()
        pm = _PACKAGE_RE.match(domain)
        if pm:
            domain, package = "package", pm.group(1)
        elif m.group(2) is not None:
            # A sub-zone belongs to the package of its parent zone.
            parent = self._name_of(f"intel-rapl:{m.group(1)}")
            ppm = _PACKAGE_RE.match(parent.lower()) if parent else None
            package = ppm.group(1) if ppm else ""
        return (zone, domain, package, _SCOPES.get(domain, SCOPE_UNKNOWN))

    # -- reading --------------------------------------------------------------------------------------

    def _read_int(self, zone: str, attribute: str) -> int:
        text = self._read(os.path.join(self._root, zone, attribute)).strip()
        value = int(text)
        if value < 0:
            raise ValueError(f"negative value {text!r}")
        return value

    def _read_energy(self, zone: str, state: _Zone) -> bool:
        """Advance the zone's total from a fresh energy_uj reading. False if it could not be read."""
        if state.max_range_uj is None:
            try:
                state.max_range_uj = self._read_int(zone, "max_energy_range_uj") or None
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                if not state.range_logged:
                    log.info(
                        "RAPL zone %s: max_energy_range_uj unreadable (%s); a counter wrap will be counted "
                        "in gpuenergy_rapl_resets_total and its energy partly lost", zone, _why(exc),
                    )
                    state.range_logged = True
        try:
            raw = self._read_int(zone, "energy_uj")
        except PermissionError as exc:
            self._failed(zone, state, "permission", exc)
            return False
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self._failed(zone, state, "error", exc)
            return False
        if state.failing:
            log.info("RAPL zone %s: energy_uj readable again", zone)
            state.failing = ""

        if state.last_raw_uj is None:
            # Start at the raw value (energy since the counter last wrapped), as the hardware reports it.
            state.total_uj = raw
        elif raw >= state.last_raw_uj:
            state.total_uj += raw - state.last_raw_uj
        elif state.max_range_uj is not None:
            state.total_uj += raw + (state.max_range_uj + 1) - state.last_raw_uj
            state.wraps += 1
        else:
            state.total_uj += raw
            state.resets += 1
        state.last_raw_uj = raw
        return True

    def _failed(self, zone: str, state: _Zone, kind: str, exc: BaseException) -> None:
        if state.failing == kind:
            return
        state.failing = kind
        if kind == "permission" and not self._permission_warned:
            self._permission_warned = True
            log.warning(
                "RAPL: permission denied reading %s (energy_uj is readable by root only since Linux 5.10, "
                "CVE-2020-8694); CPU energy is not exported for this zone (gpuenergy_rapl_readable 0). "
                "Run the exporter as root, grant it CAP_DAC_READ_SEARCH, or make energy_uj readable to its "
                "group with a udev rule (see the docs), or disable this with --no-collector.rapl",
                os.path.join(self._root, zone, "energy_uj"),
            )
        elif kind == "permission":
            log.debug("RAPL zone %s: permission denied reading energy_uj", zone)
        else:
            log.warning("RAPL zone %s: cannot read energy_uj (%s); the zone is skipped until it can",
                        zone, _why(exc))

    # -- the collector contract -----------------------------------------------------------------------

    def update(self) -> list[Metric]:
        zones = self._zone_dirs()
        if not zones:
            self._zones.clear()
            # "No data here" (a VM, a container without /sys, not x86): collector_success 0 as its HELP says,
            # logged once at debug level by _log_absent, never as an error (node_exporter's ErrNoData).
            raise NoData("no RAPL zones (see the debug log for why)")
        energy, readable, wraps, resets = (ENERGY.family(), READABLE.family(), WRAPS.family(),
                                           RESETS.family())
        present = set(zones)
        for gone in set(self._zones) - present:
            del self._zones[gone]
        for zone in zones:
            state = self._zones.get(zone)
            if state is None:
                state = self._zones[zone] = _Zone(labels=self._labels_for(zone))
            ok = self._read_energy(zone, state)
            metrics.add(readable, state.labels, 1 if ok else 0)
            if ok:
                metrics.add(energy, state.labels, state.total_uj / 1e6)
            if state.last_raw_uj is not None:
                metrics.add(wraps, state.labels, state.wraps)
                metrics.add(resets, state.labels, state.resets)
        return [energy, readable, wraps, resets]


def _zone_sort_key(zone: str) -> tuple[int, int]:
    m = _ZONE_RE.match(zone)
    assert m is not None
    return int(m.group(1)), -1 if m.group(2) is None else int(m.group(2))


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
    return str(exc)


def _build(w: Wiring) -> RaplCollector:
    return RaplCollector(sysfs=w.config.path_sysfs)


register(CollectorSpec(
    "rapl", True, "CPU package/DRAM energy from the Linux powercap (RAPL) tree.", order=20, build=_build,
    title="CPU and DRAM energy, RAPL (collector `rapl`)",
    flags=(Flag("path.sysfs", existing_dir, "/sys", "sysfs mount point (RAPL powercap tree).", "PATH"),),
))
