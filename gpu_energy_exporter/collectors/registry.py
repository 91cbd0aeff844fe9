"""The collector registry: every collector declares itself in its own module, and the command line, the
daemon's wiring and the generated docs (docs/configuration.md, docs/metrics.md) are read from here.

A collector module calls ``register(CollectorSpec(...))`` at import: its name (``--collector.<name>``), whether
it is on by default, its help, its own flags (with their environment variables), the title of its section in
the metric catalogue and ``build``, the factory the daemon calls when the collector is enabled. ``specs()``
imports every module of this package once (of a subpackage, its ``collector`` module: ``kubernetes``, ``slurm``
and ``health`` keep their other modules beside it), so adding a collector is adding one file (node_exporter's
``registerCollector`` in each collector's ``init``, in Python).

Because every collector's module is imported at start, enabled or not, its top-level imports must stay
light: what only the running collector needs (grpc, http.client, a thread pool) is imported in ``build`` or
later (tests/test_daemon_imports.py checks what the default daemon loads).

``build`` gets a ``Wiring``: the configuration, the clock, what the daemon shares with collectors (the GPU
backend's factory, the carbon intensity, "read every energy counter now") and the collectors built before
it, in ``order``. It returns the collector (or None: nothing to run, e.g. the health collector without the
gpu collector), and may hand the sampler a hook (``sampler_hooks``) or a thread the daemon starts and stops
(``services``).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.flagtypes import ENV_PREFIX, Flag

if TYPE_CHECKING:
    from gpu_energy_exporter.devices.base import GPUBackend


class Settings(Protocol):
    """What a factory reads of the configuration: ``enabled(name)`` and one attribute per flag (its ``dest``)."""

    def enabled(self, collector: str) -> bool: ...

    def __getattr__(self, name: str) -> Any: ...


class Service(Protocol):
    """A thread a collector needs beside the sampler (the Slurm directory watch): started after the sampler,
    stopped before it."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class Wiring:
    """What a collector's factory is given, and what it may hand back besides its collector."""

    config: Settings
    clock: Callable[[], float]
    #: every GPU's energy counter read in a sample taken now (a member's edge: a pod's start, a job's prolog)
    read_counters_now: Callable[[], None]
    #: the GPU backend (NVML, or a test's fake); None: the daemon's default for ``--nvml.library``
    backend_factory: Callable[[], GPUBackend] | None = None
    #: the carbon intensity resolved at start (the ledger prices CO2 with it whatever the carbon collector)
    intensity: Any = None
    #: the one watch of the intensity in force (``collectors.carbon.IntensityWatch``)
    intensity_watch: Any = None
    #: the collectors built so far, by name
    built: dict[str, Collector] = field(default_factory=dict)
    #: keyword arguments for the sampler (``xid_events``, ``slurm_jobs``)
    sampler_hooks: dict[str, Any] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)

    def require(self, name: str, by: str) -> Collector:
        """The collector ``name``, which ``by`` cannot run without: a ConfigError saying so when it is off."""
        collector = self.built.get(name)
        if collector is None:
            raise ConfigError(f"--collector.{by} needs the {name} collector (remove --no-collector.{name})")
        return collector


@dataclass(frozen=True)
class CollectorSpec:
    name: str  # --collector.<name>
    default: bool
    help: str
    #: the collector's own flags: they have no effect while it is off (the daemon warns at start)
    flags: tuple[Flag, ...] = ()
    #: the factory, called in ``order`` when the collector is enabled; None: an option another collector's
    #: factory reads with ``config.enabled(name)`` (``processes`` and ``gpm``, read by ``gpu``)
    build: Callable[[Wiring], Collector | None] | None = None
    #: build order, and the order of --help and the docs (the gpu collector first: others read its state)
    order: int = 100
    #: the section title of its metrics in docs/metrics.md ("" when it has no metrics of its own)
    title: str = ""
    #: validates its flags' values together (raises ConfigError), whether or not the collector is enabled
    check: Callable[[Settings], None] | None = None

    @property
    def dest(self) -> str:
        return "collector_" + self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


_SPECS: dict[str, CollectorSpec] = {}
_LOCK = threading.Lock()
_DISCOVERED = False


def register(spec: CollectorSpec) -> CollectorSpec:
    """Declare a collector (at its module's import). Its flags are marked as its own."""
    flags = tuple(f if f.collector == spec.name else replace(f, collector=spec.name) for f in spec.flags)
    spec = replace(spec, flags=flags)
    with _LOCK:
        known = _SPECS.get(spec.name)
        if known is not None and known.build is not spec.build:
            raise ValueError(f"collector {spec.name!r} is registered twice")
        _SPECS[spec.name] = spec
    return spec


def specs() -> tuple[CollectorSpec, ...]:
    """Every collector, in build order (each module of this package imported once to register its own)."""
    global _DISCOVERED
    if not _DISCOVERED:
        package = importlib.import_module(__package__ or "gpu_energy_exporter.collectors")
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.startswith("_"):
                continue
            name = f"{package.__name__}.{module.name}"
            if module.ispkg:  # a collector with modules of its own (kubernetes, slurm, health): its collector
                name += ".collector"
                if importlib.util.find_spec(name) is None:
                    continue
            importlib.import_module(name)
        _DISCOVERED = True
    with _LOCK:
        return tuple(sorted(_SPECS.values(), key=lambda s: (s.order, s.name)))


def collector_flags() -> tuple[Flag, ...]:
    """Every collector's own flags, collector by collector."""
    return tuple(f for s in specs() for f in s.flags)


def build(wiring: Wiring) -> list[Collector]:
    """Build every enabled collector in order; ``wiring.built`` holds them by name afterwards."""
    out: list[Collector] = []
    for spec in specs():
        if spec.build is None or not wiring.config.enabled(spec.name):
            continue
        collector = spec.build(wiring)
        if collector is not None:
            wiring.built[spec.name] = collector
            out.append(collector)
    return out
