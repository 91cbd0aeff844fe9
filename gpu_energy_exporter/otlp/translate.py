"""Where an OTLP data point becomes a Prometheus sample: names, labels and values.

Two layers:

- ``metric_name``, ``unit_name``, ``label_name`` and ``attribute_value`` translate single names and
  values exactly as the OpenTelemetry "Prometheus and OpenMetrics Compatibility" rules give them, in
  the flavour that Prometheus's own OTLP receiver applies with ``otlp.translation_strategy:
  UnderscoreEscapingWithSuffixes`` (``github.com/prometheus/otlptranslator``) and the Collector's
  prometheus exporter (``pkg/translator/prometheus``), so a dashboard written against either works
  unchanged against this exporter.
- ``translate_request`` walks a decoded ``ExportMetricsServiceRequest`` and turns every data point into a
  ``Point`` (Prometheus name, sorted labels, value, temporality) or a counted rejection with a reason.
  All validation happens here, so the store only ever sees well-formed points.

Choices where the implementations and the spec text differ (each follows the reference implementations,
because dashboard compatibility is the goal):

- Label names are not collapsed (``a..b`` gives ``a__b``): the spec says multiple underscores MUST be
  collapsed, but Prometheus (``label_name_preserve_multiple_underscores: true`` by default) and the
  Collector both keep them. Leading digits give ``key_1x``, a single leading underscore ``key_x``.
- ``otel_scope_name`` / ``otel_scope_version`` labels are not added (Prometheus's receiver default,
  ``promote_scope_metadata: false``); the training helper's labels are the join keys.
- Resource attributes never become ``job`` / ``instance``: those are the exporter's own target labels in
  Prometheus. They are exposed once per resource as ``target_info`` (see the store).

Bounds (``Limits``, one ``--otlp.*`` flag each) are applied here, before the store's lock is taken, so that
nothing unbounded is ever built: a point is rejected (counted by reason, named in the response's
``partial_success``) when a metric name, label name or label value is longer than ``max_label_length``,
when it has more than ``max_labels_per_point`` attributes, more than ``max_buckets_per_point`` histogram
buckets or ``max_quantiles_per_point`` summary quantiles, when its estimated size (``series_bytes``) is over
``max_series_bytes``, or when its time (or start time) is more than ``max_future_skew_ns`` after the
request arrived. Non-finite values are rejected (``non_finite``) where they would be stored for ever:
counters, histogram and summary sums. Gauges (and cumulative up-down sums) may be NaN or +-Inf, as in
Prometheus: the next point replaces them. Summary quantile values may be NaN (a summary with no
observations). Metric descriptions longer than ``MAX_HELP_LENGTH`` are cut.

This module never touches the store and never performs I/O.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from google.protobuf.message import Message

Kind = Literal["counter", "gauge", "unknown", "histogram", "summary"]
#: How a metric is classified for naming (otlptranslator's MetricType): only "counter" gets ``_total``
#: and only "gauge" gets ``_ratio`` for unit "1"; "updown" (non-monotonic sum) gets neither.
NameKind = Literal["counter", "gauge", "updown", "histogram", "summary", "unknown"]

#: Names the exporter exposes itself; a push must never shadow them (a duplicate series breaks a scrape).
RESERVED_PREFIXES: tuple[str, ...] = ("gpuenergy_",)

#: Metric descriptions are cut to this many characters (metadata, not worth rejecting a point for).
MAX_HELP_LENGTH = 1024

# OTLP AggregationTemporality enum values (opentelemetry/proto/metrics/v1/metrics.proto).
TEMPORALITY_DELTA = 1
TEMPORALITY_CUMULATIVE = 2
# DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK: the stream ended (Prometheus staleness).
FLAG_NO_RECORDED_VALUE = 1

# ----------------------------------------------------------------------------------------------------
# units: otlptranslator's unitMap / perUnitMap (the UnderscoreEscapingWithSuffixes mapping)

UNIT_MAP: dict[str, str] = {
    # time
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds",
    # bytes
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    # SI
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    # misc
    "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent",
}
PER_UNIT_MAP: dict[str, str] = {
    "s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year",
}

# A metric name token is a run of [a-zA-Z0-9:]; everything else (underscore included) separates tokens,
# which is how the reference implementation both replaces invalid characters and collapses "__".
_METRIC_SEPARATORS = re.compile(r"[^a-zA-Z0-9:]+")
_INVALID_UNIT_CHARS = re.compile(r"[^a-zA-Z0-9:]")
_MULTI_UNDERSCORE = re.compile(r"__+")
_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")
_SHORT_NEG_EXPONENT = re.compile(r"e-0(\d)$")


def _unit_suffixes(unit: str) -> tuple[str, str]:
    """(main, per) unit words before cleaning; ``{annotations}`` are dropped, "1" maps to ""."""
    parts = unit.split("/", 1)
    main = per = ""
    main_otel = parts[0].strip()
    if main_otel and "{" not in main_otel and "}" not in main_otel:
        main = UNIT_MAP.get(main_otel, main_otel)
    if len(parts) > 1 and parts[1]:
        per_otel = parts[1].strip()
        if per_otel and "{" not in per_otel and "}" not in per_otel:
            per = PER_UNIT_MAP.get(per_otel, per_otel)
        if per:
            per = "per_" + per
    return main, per


def _clean_unit(unit: str) -> str:
    return _MULTI_UNDERSCORE.sub("_", _INVALID_UNIT_CHARS.sub("_", unit)).removeprefix("_")


def unit_name(unit: str) -> str:
    """The Prometheus unit word for an OTel (UCUM) unit: ``s`` -> ``seconds``, ``By/s`` ->
    ``bytes_per_second``, ``1`` and ``{token}`` -> ``""``."""
    main, per = _unit_suffixes(unit)
    main, per = _clean_unit(main), _clean_unit(per)
    if main and per:
        out = main + "_" + per
    else:
        out = main or per
    return out.strip("_") if out else out


def metric_name(name: str, unit: str, kind: NameKind) -> str:
    """The Prometheus metric name for an OTel metric, with unit and type suffixes.

    Returns ``""`` when nothing valid is left (the caller rejects the metric). Histogram and summary
    names are the family base name (``_bucket`` / ``_sum`` / ``_count`` come at exposition); counters
    include ``_total``.
    """
    tokens = [t for t in _METRIC_SEPARATORS.split(name) if t]
    if not tokens:
        return ""
    main, per = _unit_suffixes(unit)
    main, per = _clean_unit(main), _clean_unit(per)
    # The unit is added unless the name already carries it as a whole token (spec: "unless the metric
    # name already contains the unit").
    if main in tokens:
        main = ""
    if per == "per_":
        per = ""
    else:
        per = per.removesuffix("_")
        if per in tokens:
            per = ""
    if per:
        main = main.removesuffix("_")
    if main:
        tokens.append(main)
    if per:
        tokens.append(per)
    if kind == "counter":
        tokens = [t for t in tokens if t != "total"]
        tokens.append("total")
    # Only gauges get _ratio: some receivers wrongly use unit "1" for counts (otlptranslator's note).
    if unit == "1" and kind == "gauge":
        tokens = [t for t in tokens if t != "ratio"]
        tokens.append("ratio")
    out = "_".join(tokens)
    if out and out[0].isdigit():
        out = "_" + out
    return out


def label_name(key: str) -> str:
    """The Prometheus label name for an attribute key; ``""`` if none is possible.

    ``http.method`` -> ``http_method``, ``1st`` -> ``key_1st``, ``_x`` -> ``key_x``, ``__x`` stays (the
    caller rejects reserved ``__`` names).
    """
    if not key:
        return ""
    out = _INVALID_LABEL_CHARS.sub("_", key)
    if out[0].isdigit():
        out = "key_" + out
    elif out.startswith("_") and not out.startswith("__"):
        out = "key" + out
    if not out.strip("_"):
        return ""
    return out


# ----------------------------------------------------------------------------------------------------
# attribute values: the OTel attribute spec's string conversion, as pcommon.Value.AsString does it


def format_double(value: float) -> str:
    """A double as JSON/ES6 number text (Go's ``float64AsString``): ``1`` not ``1.0``, ``0.00001``,
    ``1e-7``, ``1e+21``."""
    if math.isinf(value) or math.isnan(value):
        go = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
        return "json: unsupported value: " + go
    text = repr(value)  # shortest round-trip digits, like Go's precision -1
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        # repr already uses exponent form in these ranges; Go then trims "e-07" to "e-7".
        return _SHORT_NEG_EXPONENT.sub(r"e-\1", text)
    if "e" in text:
        text = format(Decimal(text), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _json_text(value: Any) -> str:
    """Go's json.Marshal of a raw attribute value (sorted keys, HTML-escaped, no spaces)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format_double(value)
    if isinstance(value, str):
        return _json_string(value)
    if isinstance(value, list):
        return "[" + ",".join(_json_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(_json_string(k) + ":" + _json_text(value[k]) for k in sorted(value)) + "}"
    raise TypeError(type(value))


def _json_string(text: str) -> str:
    out = json.dumps(text, ensure_ascii=False)
    return (out.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _raw_value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    if which == "string_value":
        return any_value.string_value
    if which == "bool_value":
        return any_value.bool_value
    if which == "int_value":
        return any_value.int_value
    if which == "double_value":
        return any_value.double_value
    if which == "bytes_value":
        return base64.b64encode(any_value.bytes_value).decode("ascii")
    if which == "array_value":
        return [_raw_value(v) for v in any_value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _raw_value(kv.value) for kv in any_value.kvlist_value.values}
    return None


def attribute_value(any_value: Any) -> str:
    """An OTLP ``AnyValue`` as a label value string (strings as-is, ``true``/``false``, decimal ints,
    ES6-style doubles, base64 bytes, JSON arrays and maps; unset is ``""``)."""
    which = any_value.WhichOneof("value")
    if which == "string_value":
        return any_value.string_value
    if which == "int_value":
        return str(any_value.int_value)
    if which == "bool_value":
        return "true" if any_value.bool_value else "false"
    if which == "double_value":
        return format_double(any_value.double_value)
    if which is None:
        return ""
    raw = _raw_value(any_value)
    if isinstance(raw, str):  # bytes
        return raw
    return _json_text(raw)


# ----------------------------------------------------------------------------------------------------
# request translation

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-point bounds applied at translation (see the module docstring); defaults are the flags'."""

    max_label_length: int = 2048
    max_labels_per_point: int = 32
    max_buckets_per_point: int = 256
    max_quantiles_per_point: int = 64
    max_series_bytes: int = 256 * 1024
    max_future_skew_ns: int = 300 * 10**9

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) <= 0 and name != "max_future_skew_ns":
                raise ValueError(f"{name} must be positive")
        if self.max_future_skew_ns < 0:
            raise ValueError("max_future_skew_ns must not be negative")


DEFAULT_LIMITS = Limits()

#: Fixed cost of one series in ``series_bytes`` (the objects that hold it, whatever its labels) and of
#: each of its samples (a ``Sample`` tuple and, for a bucket, its label dictionary), measured with
#: tracemalloc on helper-like series: the estimate is within a factor 1.5 of what the store holds.
SERIES_OVERHEAD_BYTES = 1024
SAMPLE_OVERHEAD_BYTES = 150


def series_bytes(name: str, labels: Labels, kind: str, buckets: int = 0, quantiles: int = 0) -> int:
    """Estimated memory a series costs the store: its exposition lines four times over (the sample heads
    built once per label set, the encoded lines, the family's encoded block they are joined into, and the
    label dictionary and values they are built from), and a fixed overhead. Used for
    ``--otlp.max-series-bytes`` and ``--otlp.max-bytes``; it grows linearly with what a push controls (label
    sizes, bucket and quantile counts), which is what matters for a bound."""
    return _series_cost(name, _label_chars(labels), kind, buckets, quantiles)


def _label_chars(labels: Labels) -> int:
    return sum(len(k) + len(v) + 4 for k, v in labels)


def _series_cost(name: str, label_chars: int, kind: str, buckets: int = 0, quantiles: int = 0) -> int:
    """``series_bytes`` with the labels' part already counted (``_label_chars``)."""
    line = len(name) + label_chars + 32
    if kind == "histogram":
        samples = max(buckets, 1) + 2
        lines = (samples - 2) * (line + 20) + 2 * (line + 8)
    elif kind == "summary":
        samples = quantiles + 2
        lines = quantiles * (line + 24) + 2 * (line + 8)
    else:
        samples = 1
        lines = line
    return 4 * lines + SAMPLE_OVERHEAD_BYTES * samples + SERIES_OVERHEAD_BYTES


@dataclass(slots=True)
class Point:
    """One data point, translated and validated, ready for the store."""

    kind: Kind
    name: str  # Prometheus family name (counters end in _total)
    help: str
    unit: str  # Prometheus unit metadata, "" unless the name ends with it
    labels: Labels  # sorted by name, empty values dropped
    run_id: str
    start_ns: int
    time_ns: int
    delta: bool = False
    value: float = 0.0
    bounds: tuple[float, ...] = ()  # histogram upper bounds (without +Inf)
    counts: tuple[int, ...] = ()  # histogram per-bucket counts, len(bounds) + 1 (or empty)
    count: int = 0  # histogram / summary count
    sum: float | None = None  # histogram / summary sum (None: not recorded)
    quantiles: tuple[tuple[float, float], ...] = ()  # summary (quantile, value)
    no_value: bool = False  # the sender marked the stream as ended
    cost: int = 0  # series_bytes() of the series this point gives


@dataclass
class Batch:
    """Everything one request carried, after translation."""

    points: list[Point] = field(default_factory=list)
    received: int = 0  # data points in the request (accepted + rejected)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    messages: dict[str, str] = field(default_factory=dict)  # reason -> first human-readable message
    resources: list[Labels] = field(default_factory=list)  # target_info label sets

    def reject(self, reason: str, count: int, message: str) -> None:
        if count <= 0:
            return
        self.rejected[reason] = self.rejected.get(reason, 0) + count
        self.messages.setdefault(reason, message)


class _Rejected(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# Bounded caches: attribute keys and metric identities repeat on every export of a training run.
_LABEL_CACHE: dict[str, str] = {}
_NAME_CACHE: dict[tuple[str, str, str], str] = {}
_CACHE_MAX = 8192
#: Longer names are translated every time: the caches stay under ~8192 * 2 * 128 characters each, whatever
#: --otlp.max-label-length allows.
_CACHE_KEY_MAX = 128


def _cached_label(key: str) -> str:
    if len(key) > _CACHE_KEY_MAX:
        return label_name(key)
    out = _LABEL_CACHE.get(key)
    if out is None:
        if len(_LABEL_CACHE) >= _CACHE_MAX:
            _LABEL_CACHE.clear()
        out = _LABEL_CACHE[key] = label_name(key)
    return out


def _cached_metric_name(name: str, unit: str, kind: NameKind) -> str:
    if len(name) + len(unit) > _CACHE_KEY_MAX:
        return metric_name(name, unit, kind)
    key = (name, unit, kind)
    out = _NAME_CACHE.get(key)
    if out is None:
        if len(_NAME_CACHE) >= _CACHE_MAX:
            _NAME_CACHE.clear()
        out = _NAME_CACHE[key] = metric_name(name, unit, kind)
    return out


_UNIT_CACHE: dict[str, str] = {}


def _cached_unit(unit: str) -> str:
    out = _UNIT_CACHE.get(unit)
    if out is None:
        out = unit_name(unit)
        if len(unit) <= _CACHE_KEY_MAX:
            if len(_UNIT_CACHE) >= _CACHE_MAX:
                _UNIT_CACHE.clear()
            _UNIT_CACHE[unit] = out
    return out


def translate_labels(attributes: Sequence[Any], reserved: tuple[str, ...] = (),
                     limits: Limits = DEFAULT_LIMITS) -> Labels:
    """OTLP ``KeyValue`` attributes to sorted Prometheus labels.

    Keys that sanitise to the same label are joined with ``;`` in the order of the original keys (spec,
    "Metric Attributes"); labels with empty values are dropped, as Prometheus treats them as absent (two
    series differing only by one would be a duplicate sample). Raises ``_Rejected`` for a key with no
    valid label name, a reserved ``__`` name or one in ``reserved`` (``le`` on histograms), and for more
    attributes or longer names and values than ``limits`` allow.
    """
    if len(attributes) > limits.max_labels_per_point:
        raise _Rejected("too_many_labels", f"{len(attributes)} attributes, more than "
                        f"{limits.max_labels_per_point} (--otlp.max-labels-per-point)")
    longest = limits.max_label_length
    pairs: list[tuple[str, str]] = []
    for kv in attributes:
        key = kv.key
        if len(key) > longest:
            raise _Rejected("label_too_long", f"attribute name of {len(key)} characters {key[:40]!r}..., "
                            f"longer than {longest} (--otlp.max-label-length)")
        value = attribute_value(kv.value)
        if len(value) > longest:
            raise _Rejected("label_too_long", f"attribute {key[:100]!r} has a value of {len(value)} characters, "
                            f"longer than {longest} (--otlp.max-label-length)")
        pairs.append((key, value))
    if len(pairs) > 1:
        pairs.sort()
    out: dict[str, str] = {}
    for key, value in pairs:
        label = _cached_label(key)
        if not label:
            raise _Rejected("invalid_label", f"attribute {key!r} has no valid Prometheus label name")
        if label.startswith("__"):
            raise _Rejected("invalid_label", f"attribute {key!r} gives reserved label name {label!r}")
        if label in reserved:
            raise _Rejected("invalid_label", f"attribute {key!r} clashes with the {label!r} label")
        if label in out:
            joined = out[label] = out[label] + ";" + value
            if len(joined) > longest:
                raise _Rejected("label_too_long", f"attributes joined into label {label!r} give a value of "
                                f"{len(joined)} characters, longer than {longest} (--otlp.max-label-length)")
        else:
            out[label] = value
    return tuple(sorted((k, v) for k, v in out.items() if v != ""))


#: Translated data-point attributes by their serialized form: a trainer sends the same few attribute lists
#: on every export (run id, rank, GPU), and translating them is a third of the receiver's work per point.
#: Bounded in entries and key size (longer attribute lists are translated every time).
_ATTRS_CACHE: dict[tuple[object, ...], tuple[Labels, str, int]] = {}  # (reserved, the two limits used, *attributes)
_ATTRS_CACHE_MAX = 512
_ATTRS_KEY_MAX = 512


def _point_labels(attributes: Sequence[Any], reserved: tuple[str, ...],
                  limits: Limits) -> tuple[Labels, str, int]:
    """``translate_labels``, the labels' ``run_id`` and ``_label_chars``, cached per attribute list."""
    if len(attributes) <= limits.max_labels_per_point:
        parts = [kv.SerializeToString() for kv in attributes]
        if sum(map(len, parts)) <= _ATTRS_KEY_MAX:
            key = (reserved, limits.max_label_length, limits.max_labels_per_point, *parts)
            out = _ATTRS_CACHE.get(key)
            if out is None:
                labels = translate_labels(attributes, reserved, limits)  # a rejection is never cached
                out = (labels, _run_id(labels), _label_chars(labels))
                if len(_ATTRS_CACHE) >= _ATTRS_CACHE_MAX:
                    _ATTRS_CACHE.clear()
                _ATTRS_CACHE[key] = out
            return out
    labels = translate_labels(attributes, reserved, limits)
    return labels, _run_id(labels), _label_chars(labels)


def _run_id(labels: Labels) -> str:
    for k, v in labels:
        if k == "run_id":
            return v
    return ""


def _number(dp: Any) -> float | None:
    which = dp.WhichOneof("value")
    if which == "as_double":
        return float(dp.as_double)
    if which == "as_int":
        return float(dp.as_int)
    return None


def _metadata_type(metric: Any) -> str:
    for kv in getattr(metric, "metadata", ()):
        if kv.key == "prometheus.type":
            return attribute_value(kv.value)
    return ""


def _family_unit(prom_name: str, kind: Kind, unit: str) -> str:
    """UNIT metadata only when the name really ends with it (OpenMetrics requires the suffix)."""
    if not unit:
        return ""
    base = prom_name[: -len("_total")] if kind == "counter" else prom_name
    return unit if base.endswith("_" + unit) else ""


def translate_request(request: Message, received_ns: int, limits: Limits = DEFAULT_LIMITS) -> Batch:
    """Translate a decoded ``ExportMetricsServiceRequest`` into a ``Batch``.

    Never raises on content: anything it cannot use becomes a counted rejection with a reason.
    ``received_ns`` stands in for a data point's missing ``time_unix_nano`` and is the reference for
    ``limits.max_future_skew_ns``. A resource whose attributes break a limit gets no ``target_info``.
    """
    batch = Batch()
    for rm in request.resource_metrics:
        if rm.HasField("resource") and len(rm.resource.attributes):
            try:
                resource_labels = translate_labels(rm.resource.attributes, limits=limits)
            except _Rejected:
                resource_labels = ()
            if resource_labels:
                batch.resources.append(resource_labels)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                _translate_metric(metric, batch, received_ns, limits)
    return batch


#: What a metric's envelope translates to (kind, name, help, unit, reserved labels, delta) or its rejection
#: (reason, message), by everything it depends on: a trainer sends the same envelopes on every export.
_Descriptor = tuple[Kind, str, str, str, tuple[str, ...], bool] | tuple[str, str]
_DESCRIPTOR_CACHE: dict[tuple[object, ...], _Descriptor] = {}
_DESCRIPTOR_CACHE_MAX = 1024


def _translate_metric(metric: Any, batch: Batch, received_ns: int, limits: Limits) -> None:
    data = metric.WhichOneof("data")
    if data is None:
        return  # an empty envelope carries no points
    container = getattr(metric, data)
    points = container.data_points
    n = len(points)
    batch.received += n
    if n == 0:
        return
    if data == "sum":
        shape: tuple[object, ...] = (container.aggregation_temporality, container.is_monotonic)
    elif data == "histogram":
        shape = (container.aggregation_temporality,)
    elif data == "gauge":
        shape = (_metadata_type(metric),)
    else:
        shape = ()
    otel_name, unit, description = metric.name, metric.unit, metric.description
    key = (data, otel_name, unit, description, limits.max_label_length, *shape)
    desc = _DESCRIPTOR_CACHE.get(key)
    if desc is None:
        desc = _describe(metric, data, container, limits)
        if len(otel_name) + len(unit) + len(description) <= 4 * _CACHE_KEY_MAX:
            if len(_DESCRIPTOR_CACHE) >= _DESCRIPTOR_CACHE_MAX:
                _DESCRIPTOR_CACHE.clear()
            _DESCRIPTOR_CACHE[key] = desc
    if len(desc) == 2:
        batch.reject(desc[0], n, desc[1])
        return
    kind, prom_name, help_text, family_unit, reserved, delta = desc
    _translate_points(points, batch, received_ns, limits, otel_name, kind, prom_name, help_text, family_unit,
                      reserved, delta)


def _describe(metric: Any, data: str, container: Any, limits: Limits) -> _Descriptor:
    """The envelope's translation (see ``_DESCRIPTOR_CACHE``)."""
    otel_name = metric.name
    unit = metric.unit
    kind: Kind
    name_kind: NameKind
    delta = False
    if data == "gauge":
        kind = "unknown" if _metadata_type(metric) == "unknown" else "gauge"
        name_kind = "gauge"
    elif data == "sum":
        temporality = container.aggregation_temporality
        if temporality not in (TEMPORALITY_DELTA, TEMPORALITY_CUMULATIVE):
            return ("unsupported_temporality", f"metric {otel_name!r}: aggregation temporality unspecified")
        delta = temporality == TEMPORALITY_DELTA
        if container.is_monotonic:
            kind, name_kind = "counter", "counter"
        elif delta:
            # Spec ("Sums"): only monotonic delta sums are converted; a delta up-down sum would drift
            # for ever after one lost export.
            return ("unsupported_temporality", f"metric {otel_name!r}: delta non-monotonic sums cannot be "
                    "exposed; use cumulative temporality for UpDownCounters")
        else:
            kind, name_kind = "gauge", "updown"
    elif data == "histogram":
        temporality = container.aggregation_temporality
        if temporality not in (TEMPORALITY_DELTA, TEMPORALITY_CUMULATIVE):
            return ("unsupported_temporality", f"metric {otel_name!r}: aggregation temporality unspecified")
        delta = temporality == TEMPORALITY_DELTA
        kind, name_kind = "histogram", "histogram"
    elif data == "summary":
        kind, name_kind = "summary", "summary"
    else:
        return ("unsupported_type", f"metric {otel_name!r}: {data} is not supported (classic Prometheus "
                "exposition has no native histograms); use explicit-bucket histograms")

    if len(otel_name) + len(unit) > limits.max_label_length:
        return ("label_too_long", f"metric name {otel_name[:40]!r}... and unit have "
                f"{len(otel_name) + len(unit)} characters, more than {limits.max_label_length} "
                "(--otlp.max-label-length)")
    prom_name = _cached_metric_name(otel_name, unit, name_kind)
    if not prom_name:
        return ("invalid_name", f"metric name {otel_name!r} has no valid Prometheus form")
    if prom_name.startswith(RESERVED_PREFIXES):
        return ("invalid_name", f"metric {otel_name!r} -> {prom_name!r} uses a prefix reserved for the exporter")
    help_text = metric.description[:MAX_HELP_LENGTH] or f"{otel_name} (received over OTLP)"
    family_unit = _family_unit(prom_name, kind, _cached_unit(unit))
    reserved = ("le",) if kind == "histogram" else ("quantile",) if kind == "summary" else ()
    return (kind, prom_name, help_text, family_unit, reserved, delta)


def _translate_points(points: Any, batch: Batch, received_ns: int, limits: Limits, otel_name: str, kind: Kind,
                      prom_name: str, help_text: str, family_unit: str, reserved: tuple[str, ...],
                      delta: bool) -> None:
    latest = received_ns + limits.max_future_skew_ns
    append = batch.points.append
    for dp in points:
        try:
            labels, run_id, label_chars = _point_labels(dp.attributes, reserved, limits)
            time_ns = dp.time_unix_nano or received_ns
            start_ns = dp.start_time_unix_nano
            if time_ns > latest or start_ns > latest:
                ahead = (max(time_ns, start_ns) - received_ns) / 1e9
                raise _Rejected("future_timestamp", f"timestamp {ahead:.0f} s after the request arrived, more "
                                f"than {limits.max_future_skew_ns / 1e9:g} s (--otlp.max-future-skew); "
                                "check the sender's clock")
            no_value = bool(dp.flags & FLAG_NO_RECORDED_VALUE)
            point = Point(kind, prom_name, help_text, family_unit, labels, run_id,
                          start_ns, time_ns, delta, no_value=no_value)
            if no_value:
                append(point)
                continue
            if kind == "histogram":
                _fill_histogram(point, dp, limits)
                point.cost = _series_cost(prom_name, label_chars, kind, buckets=len(point.counts))
            elif kind == "summary":
                _fill_summary(point, dp, limits)
                point.cost = _series_cost(prom_name, label_chars, kind, quantiles=len(point.quantiles))
            else:
                value = _number(dp)
                if value is None:
                    raise _Rejected("invalid_point", "data point has no value")
                if kind == "counter":
                    if not math.isfinite(value):
                        raise _Rejected("non_finite", f"counter value {value!r}: counters must be finite "
                                        "(a non-finite total could never be counted on from)")
                    if value < 0:
                        raise _Rejected("invalid_point", f"invalid counter value {value!r}")
                point.value = value
                point.cost = _series_cost(prom_name, label_chars, kind)
            if point.cost > limits.max_series_bytes:
                raise _Rejected("series_too_large", f"series of about {point.cost} bytes, more than "
                                f"{limits.max_series_bytes} (--otlp.max-series-bytes); use fewer or shorter "
                                "labels, buckets or quantiles")
        except _Rejected as exc:
            batch.reject(exc.reason, 1, f"metric {otel_name[:200]!r}: {exc.message}")
            continue
        append(point)


def _fill_histogram(point: Point, dp: Any, limits: Limits) -> None:
    if len(dp.bucket_counts) > limits.max_buckets_per_point or \
            len(dp.explicit_bounds) >= limits.max_buckets_per_point:
        raise _Rejected("too_many_buckets", f"histogram with {max(len(dp.bucket_counts), len(dp.explicit_bounds) + 1)} "
                        f"buckets, more than {limits.max_buckets_per_point} (--otlp.max-buckets-per-point)")
    bounds = tuple(dp.explicit_bounds)
    counts = tuple(dp.bucket_counts)
    if counts and len(counts) != len(bounds) + 1:
        raise _Rejected("invalid_point", f"{len(counts)} bucket counts for {len(bounds)} bounds (want bounds + 1)")
    if any(math.isnan(b) or math.isinf(b) for b in bounds):
        raise _Rejected("invalid_point", "histogram bounds must be finite")
    if any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:], strict=False)):
        raise _Rejected("invalid_point", "histogram bounds must be strictly increasing")
    if counts and sum(counts) != dp.count:
        raise _Rejected("invalid_point", f"bucket counts add up to {sum(counts)}, count is {dp.count}")
    if dp.HasField("sum") and not math.isfinite(dp.sum):
        raise _Rejected("non_finite", f"histogram sum {dp.sum!r}: the sum must be finite")
    if not counts:
        bounds = ()
    point.bounds = bounds
    point.counts = counts
    point.count = dp.count
    point.sum = dp.sum if dp.HasField("sum") else None


def _fill_summary(point: Point, dp: Any, limits: Limits) -> None:
    if len(dp.quantile_values) > limits.max_quantiles_per_point:
        raise _Rejected("too_many_quantiles", f"summary with {len(dp.quantile_values)} quantiles, more than "
                        f"{limits.max_quantiles_per_point} (--otlp.max-quantiles-per-point)")
    quantiles = tuple(sorted((q.quantile, q.value) for q in dp.quantile_values))
    if any(not 0.0 <= q <= 1.0 for q, _ in quantiles):
        raise _Rejected("invalid_point", "summary quantiles must be between 0 and 1")
    if any(a[0] == b[0] for a, b in zip(quantiles, quantiles[1:], strict=False)):
        raise _Rejected("invalid_point", "summary quantiles must be distinct")
    if not math.isfinite(dp.sum):
        raise _Rejected("non_finite", f"summary sum {dp.sum!r}: the sum must be finite")
    point.quantiles = quantiles
    point.count = dp.count
    point.sum = dp.sum
