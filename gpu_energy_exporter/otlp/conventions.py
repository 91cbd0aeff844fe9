"""The node's readings in OpenTelemetry terms: which series are pushed (``pushed(spec)``, also used by docgen)
and how each maps onto the OpenTelemetry hardware semantic conventions, where one exists.

Conventions (semantic-conventions, ``model/hardware``): ``hw.energy`` (J, counter), ``hw.power`` (W,
gauge), ``hw.gpu.utilization`` (1), ``hw.gpu.memory.usage`` / ``.limit`` / ``.utilization``,
``hw.temperature`` (Cel, ``hw.type=temperature`` with the GPU as ``hw.parent``) and ``hw.status``, with
``hw.type``, ``hw.id`` (the GPU UUID), ``hw.name``, ``hw.vendor``, ``hw.model`` and ``hw.driver_version``.
Readings without a convention keep this project's names: ``gpuenergy.<subsystem>.<name>`` with the unit
in the OTLP unit field, which Prometheus' OTLP translation turns back into the exact series name that
``/metrics`` serves (``gpuenergy.gpu.power_average`` + ``W`` -> ``gpuenergy_gpu_power_average_watts``).

Pure: ``snapshot_points`` is a snapshot's families in, points out, tested on plain values. This module never
reads a clock, never does I/O and never imports the OpenTelemetry SDK (``otlp.push`` does all three).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import Metric

from gpu_energy_exporter.core.metrics import CATALOGUE, GPU_LABELS, NAMESPACE, MetricSpec

GPU_VENDOR = "NVIDIA"
#: The exporter's GPU labels (every per-GPU series has both).
_GPU, _GPU_UUID = GPU_LABELS

PointKind = Literal["counter", "updown", "gauge"]

#: Prometheus unit words (MetricSpec.unit) -> UCUM units used by OpenTelemetry.
_UCUM = {
    "seconds": "s", "bytes": "By", "watts": "W", "joules": "J", "celsius": "Cel", "hertz": "Hz",
    "ratio": "1", "grams": "g",
}

#: Collectors whose series the snapshot holds (and so are pushed); training and ledger series are not
#: the node's readings and are not re-pushed.
PUSHED_COLLECTORS = frozenset({"exporter", "gpu", "host", "rapl", "carbon", "kubernetes"})
#: Families never pushed: info series (their labels become attributes), and the per-process series
#: (pid cardinality belongs on a scrape, not in a push pipeline).
NOT_PUSHED = {
    "gpuenergy_gpu_info", "gpuenergy_nvml_info", "gpuenergy_carbon_info", "gpuenergy_build_info",
    "gpuenergy_gpu_process_memory_used_bytes",
}


@dataclass(frozen=True)
class OTLPPoint:
    """One data point to push, in OpenTelemetry terms."""

    name: str
    unit: str
    kind: PointKind
    description: str
    attributes: tuple[tuple[str, str], ...]
    value: float
    time_s: float


@dataclass(frozen=True)
class _Convention:
    name: str
    unit: str
    kind: PointKind


#: Prometheus family (as /metrics serves it) -> the hardware semantic convention it maps onto.
CONVENTIONS: dict[str, _Convention] = {
    "gpuenergy_gpu_energy_joules_total": _Convention("hw.energy", "J", "counter"),
    "gpuenergy_gpu_power_watts": _Convention("hw.power", "W", "gauge"),
    "gpuenergy_gpu_utilization_ratio": _Convention("hw.gpu.utilization", "1", "gauge"),
    "gpuenergy_gpu_memory_used_bytes": _Convention("hw.gpu.memory.usage", "By", "updown"),
    "gpuenergy_gpu_memory_total_bytes": _Convention("hw.gpu.memory.limit", "By", "updown"),
    "gpuenergy_gpu_temperature_celsius": _Convention("hw.temperature", "Cel", "gauge"),
    "gpuenergy_gpu_memory_temperature_celsius": _Convention("hw.temperature", "Cel", "gauge"),
    "gpuenergy_gpu_up": _Convention("hw.status", "1", "updown"),
}
#: Derived from used / total: the convention's "fraction of GPU memory used". (NVML's own "memory
#: utilisation" is the memory controller's busy time and keeps this project's name.)
MEMORY_FRACTION = _Convention("hw.gpu.memory.utilization", "1", "gauge")
#: RAPL zones whose scope does not overlap another's: CPU packages and DRAM (docs/measurement.md).
RAPL_HW_TYPES = {"package": "cpu", "dram": "memory"}


def own_name(spec: MetricSpec) -> tuple[str, str]:
    """(OTel name, UCUM unit) for a series without a convention, chosen so that Prometheus' OTLP
    translation gives back ``spec.name``."""
    base = spec.name
    if spec.kind == "counter":
        base = base.removesuffix("_total")
    unit = ""
    # The unit travels in the unit field only where the name carries it, so the translation (which
    # appends the unit word) gives back exactly the same name; "_ratio" is added to gauges of unit "1".
    for word in (spec.unit, "ratio"):
        if word in _UCUM and base.endswith("_" + word) and (word != "ratio" or spec.kind == "gauge"):
            base = base.removesuffix("_" + word)
            unit = _UCUM.get(word, "")
            break
    rest = base.removeprefix(NAMESPACE + "_")
    subsystem, _, name = rest.partition("_")
    return (f"{NAMESPACE}.{subsystem}.{name}" if name else f"{NAMESPACE}.{subsystem}"), unit


@dataclass
class _GPUAttrs:
    index: str
    uuid: str
    model: str = ""
    driver: str = ""

    def hw(self, hw_type: str = "gpu") -> list[tuple[str, str]]:
        out = [("hw.type", hw_type), ("hw.id", self.uuid), ("hw.name", f"gpu{self.index}"),
               ("hw.vendor", GPU_VENDOR)]
        if self.model:
            out.append(("hw.model", self.model))
        if self.driver:
            out.append(("hw.driver_version", self.driver))
        return out


def _gpu_attrs(families: Iterable[Metric]) -> dict[str, _GPUAttrs]:
    out: dict[str, _GPUAttrs] = {}
    for fam in families:
        if fam.name != "gpuenergy_gpu":  # the info family's base name
            continue
        for s in fam.samples:
            uuid = s.labels.get(_GPU_UUID, "")
            out[uuid] = _GPUAttrs(s.labels.get(_GPU, ""), uuid, s.labels.get("model", ""),
                                  s.labels.get("driver_version", ""))
    return out


def pushed(spec: MetricSpec) -> bool:
    """Whether ``spec``'s series travel with ``--otlp.push-endpoint`` (the node's own readings)."""
    return spec.kind != "info" and spec.name not in NOT_PUSHED and spec.collector in PUSHED_COLLECTORS


def snapshot_points(
    families: Iterable[Metric], *, taken_at: float, gpu_times: Mapping[str, float] | None = None
) -> list[OTLPPoint]:
    """The OTLP points for one snapshot's families.

    ``taken_at`` is the snapshot's time; ``gpu_times`` maps a GPU UUID to the time of that GPU's reading
    (which is what per-GPU points are stamped with). Pure: no clock, no I/O.
    """
    fams = list(families)
    gpus = _gpu_attrs(fams)
    gpu_times = gpu_times or {}
    points: list[OTLPPoint] = []
    used: dict[str, float] = {}
    total: dict[str, float] = {}
    for fam in fams:
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            spec = CATALOGUE.get(s.name)
            if spec is None or not pushed(spec):
                continue
            uuid = s.labels.get(_GPU_UUID)
            # A reading's own time, except for the GPU's status: a lost GPU's last reading stops moving,
            # and its "failed" state must stay current (a stale point would clear an alert).
            t = gpu_times.get(uuid, taken_at) if uuid and spec.name != "gpuenergy_gpu_up" else taken_at
            gpu = gpus.get(uuid) if uuid else None
            if gpu is None and uuid is not None:
                gpu = _GPUAttrs(s.labels.get(_GPU, ""), uuid)
            value = float(s.value)
            if spec.name == "gpuenergy_gpu_memory_used_bytes" and uuid:
                used[uuid] = value
            if spec.name == "gpuenergy_gpu_memory_total_bytes" and uuid:
                total[uuid] = value
            points.extend(_map(spec, dict(s.labels), value, t, gpu))
    for uuid, u in used.items():
        if total.get(uuid):
            gpu = gpus.get(uuid) or _GPUAttrs("", uuid)
            points.append(OTLPPoint(MEMORY_FRACTION.name, MEMORY_FRACTION.unit, "gauge",
                                    "Fraction of GPU memory used.", tuple(gpu.hw()), u / total[uuid],
                                    gpu_times.get(uuid, taken_at)))
    return points


def _map(spec: MetricSpec, labels: dict[str, str], value: float, t: float,
         gpu: _GPUAttrs | None) -> list[OTLPPoint]:
    conv = CONVENTIONS.get(spec.name)
    if conv is not None and gpu is not None:
        if spec.name == "gpuenergy_gpu_up":
            attrs = [("hw.type", "gpu"), ("hw.id", gpu.uuid), ("hw.name", f"gpu{gpu.index}")]
            return [
                OTLPPoint(conv.name, conv.unit, conv.kind, "Operational status of the GPU.",
                          tuple(attrs + [("hw.state", "ok")]), 1.0 if value == 1 else 0.0, t),
                OTLPPoint(conv.name, conv.unit, conv.kind, "Operational status of the GPU.",
                          tuple(attrs + [("hw.state", "failed")]), 0.0 if value == 1 else 1.0, t),
            ]
        if conv.name == "hw.temperature":
            sensor = "memory" if "memory" in spec.name else "gpu"
            attrs = [("hw.type", "temperature"), ("hw.id", f"{gpu.uuid}:{sensor}"),
                     ("hw.name", f"gpu{gpu.index} {sensor}"), ("hw.parent", gpu.uuid)]
            return [OTLPPoint(conv.name, conv.unit, conv.kind, spec.help, tuple(attrs), value, t)]
        attrs = gpu.hw()
        if conv.name == "hw.gpu.utilization":
            attrs.append(("hw.gpu.task", "general"))
        return [OTLPPoint(conv.name, conv.unit, conv.kind, spec.help, tuple(attrs), value, t)]
    if spec.name == "gpuenergy_rapl_energy_joules_total" and labels.get("scope") in RAPL_HW_TYPES:
        attrs = [("hw.type", RAPL_HW_TYPES[labels["scope"]]), ("hw.id", "rapl:" + labels.get("zone", "")),
                 ("hw.name", labels.get("domain", ""))]
        return [OTLPPoint("hw.energy", "J", "counter", spec.help, tuple(attrs), value, t)]
    name, unit = own_name(spec)
    kind: PointKind = "counter" if spec.kind == "counter" else "gauge"
    return [OTLPPoint(name, unit, kind, spec.help, tuple(sorted(labels.items())), value, t)]


__all__ = [
    "CONVENTIONS", "MEMORY_FRACTION", "NOT_PUSHED", "OTLPPoint", "PUSHED_COLLECTORS", "RAPL_HW_TYPES", "own_name",
    "pushed", "snapshot_points",
]
