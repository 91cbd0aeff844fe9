"""Where a decoded OTLP request becomes ``Point``s: validation, limits and the translation of every data point.

``translate_request`` walks a decoded ``ExportMetricsServiceRequest`` and turns every data point into a
``Point`` (Prometheus name, sorted labels, value, temporality) or a counted rejection with a reason. All
validation happens here, so the store only ever sees well-formed points. Names and label values follow
``otlp.naming`` (the OpenTelemetry compatibility rules); the model (``Point``, ``Batch``, ``Limits``) is
``otlp.points``.

Choices where the implementations and the spec text differ (each follows the reference implementations,
because dashboard compatibility is the goal):

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

This module never touches the store, never decodes bytes (the receiver does) and never performs I/O; its
only state is bounded caches of names and attribute lists that repeat on every export.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import Message

from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.core.clientid import Peer, address_peer, claim_refusal, client_id
from gpu_energy_exporter.core.contract import ATTR_RUN_ID, LABEL_POD_UID
from gpu_energy_exporter.otlp import census
from gpu_energy_exporter.otlp import reserved as reserved_names
from gpu_energy_exporter.otlp.census import DEFAULT_REQUEST_LIMITS, RequestLimits, TooMuch
from gpu_energy_exporter.otlp.distributions import Rejected as _Rejected
from gpu_energy_exporter.otlp.distributions import fill_distribution as _fill_distribution
from gpu_energy_exporter.otlp.naming import NameKind, attribute_value, label_name, metric_name, unit_name
from gpu_energy_exporter.otlp.points import DEFAULT_LIMITS, Batch, Kind, Labels, Limits, Point, label_chars, series_cost
from gpu_energy_exporter.otlp.wire import as_wire, key_value

#: Names the exporter exposes itself; a push must never shadow them (a duplicate series breaks a scrape).
RESERVED_PREFIXES: tuple[str, ...] = ("gpuenergy_",)

#: Metric descriptions are cut to this many characters (metadata, not worth rejecting a point for).
MAX_HELP_LENGTH = 1024

# OTLP AggregationTemporality enum values (opentelemetry/proto/metrics/v1/metrics.proto).
TEMPORALITY_DELTA = 1
TEMPORALITY_CUMULATIVE = 2
# DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK: the stream ended (Prometheus staleness).
FLAG_NO_RECORDED_VALUE = 1


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
        out = remember(_LABEL_CACHE, key, label_name(key), _CACHE_MAX)
    return out


def _cached_metric_name(name: str, unit: str, kind: NameKind) -> str:
    if len(name) + len(unit) > _CACHE_KEY_MAX:
        return metric_name(name, unit, kind)
    key = (name, unit, kind)
    out = _NAME_CACHE.get(key)
    if out is None:
        out = remember(_NAME_CACHE, key, metric_name(name, unit, kind), _CACHE_MAX)
    return out


_UNIT_CACHE: dict[str, str] = {}


def _cached_unit(unit: str) -> str:
    out = _UNIT_CACHE.get(unit)
    if out is None:
        out = unit_name(unit)
        if len(unit) <= _CACHE_KEY_MAX:
            remember(_UNIT_CACHE, unit, out, _CACHE_MAX)
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


#: Translated data-point attributes by their bytes as sent (``wire``): a trainer sends the same few attribute
#: lists on every export (run id, rank, GPU), and translating them is a third of the receiver's work per point.
#: Bounded in entries and key size (longer attribute lists are translated every time). The value: the labels,
#: their ``run_id``, ``label_chars`` and which training-contract families accept them
#: (``otlp.reserved.labels_fit``: checked once per label set, not once per point).
_Attrs = tuple[Labels, str, int, int]
_ATTRS_CACHE: dict[tuple[object, ...], _Attrs] = {}  # (reserved, the two limits used, *attributes)
_ATTRS_CACHE_MAX = 512
_ATTRS_KEY_MAX = 512


def _point_labels(attributes: Sequence[bytes], reserved: tuple[str, ...], limits: Limits) -> _Attrs:
    """``translate_labels`` of a data point's attributes (``KeyValue`` bytes, ``wire``), the labels'
    ``run_id``, ``label_chars`` and ``reserved_names.labels_fit``, cached per attribute list. Raises
    ``wire.Undecodable`` for bytes that are not a ``KeyValue`` (all of them are parsed before any limit is
    applied, as the full parse would)."""
    key = None
    if len(attributes) <= limits.max_labels_per_point:
        key = (reserved, limits.max_label_length, limits.max_labels_per_point, *attributes)
        out = _ATTRS_CACHE.get(key)
        if out is not None:
            return out
    labels = translate_labels([key_value(raw) for raw in attributes], reserved, limits)  # a rejection is never cached
    out = (labels, _run_id(labels), label_chars(labels), reserved_names.labels_fit(labels))
    if key is not None and sum(map(len, attributes)) <= _ATTRS_KEY_MAX:
        remember(_ATTRS_CACHE, key, out, _ATTRS_CACHE_MAX)
    return out


def _check_attributes(points: Any) -> None:
    """Parse every attribute of ``points`` whose metric is rejected as a whole (``wire.Undecodable``): a body
    the full parse refuses is refused whatever its metrics are."""
    for dp in points:
        for raw in dp.attributes:
            key_value(raw)


def _run_id(labels: Labels) -> str:
    for k, v in labels:
        if k == ATTR_RUN_ID:
            return v
    return ""


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


def translate_request(request: Message, received_ns: int, limits: Limits = DEFAULT_LIMITS,
                      peer: Peer | str = "", bounds: RequestLimits = DEFAULT_REQUEST_LIMITS) -> Batch:
    """Translate a decoded ``ExportMetricsServiceRequest`` (OTLP's, or ``wire.WireRequest``) into a ``Batch``.

    Never raises on content: anything it cannot use becomes a counted rejection with a reason; only a
    ``WireRequest`` whose attribute bytes are not ``KeyValue`` messages raises ``wire.Undecodable`` (OTLP's
    own parser refuses such a body). ``received_ns`` stands in for a data point's missing ``time_unix_nano``
    and is the reference for ``limits.max_future_skew_ns``. A resource whose attributes break a limit gets
    no ``target_info``. ``peer``: who sent it (``core.clientid.Peer``, or an address); with the resource's
    claims it makes each point's ``client``. A resource whose ``process.pid`` the kernel contradicts
    (``core.clientid.claim_refusal``) has all its points rejected (``identity_mismatch``) and no ``target_info``.
    A request of more than ``bounds.max_points`` data points, or whose translation would make more than
    ``bounds.max_made_bytes`` (``Batch.made``: points, their labels, buckets and quantiles), raises
    ``census.TooMuch`` as soon as it is known, before more is made.
    """
    batch = Batch()
    if isinstance(peer, str):
        peer = address_peer(peer)
    scopes = metrics = 0  # against the census' caps: it bounds whole scopes without counting them (census)
    for rm in as_wire(request).resource_metrics[:]:
        resource_labels: Labels = ()
        if rm.HasField("resource") and len(rm.resource.attributes):
            resource_labels = _resource_labels(rm.resource, limits)
            if peer.pod is not None and resource_labels:
                resource_labels = _in_pod(resource_labels, peer.pod[2])
            batch.made += census.LABEL_MADE * len(resource_labels)
            if batch.made > bounds.max_made_bytes:
                raise TooMuch(bounds.refusal(batch.received, batch.made))
            if resource_labels:
                why = claim_refusal(peer, resource_labels)
                if why is not None:
                    _reject_resource(rm, batch, why)
                    continue
                batch.resources.append(resource_labels)
        client = client_id(peer, resource_labels)
        scopes += len(rm.scope_metrics)
        if scopes > bounds.max_resources:
            raise TooMuch(census.kind_refusal("scopes", bounds.max_resources))
        for sm in rm.scope_metrics[:]:
            metrics += len(sm.metrics)
            if metrics > bounds.max_metrics:
                raise TooMuch(census.kind_refusal("metrics", bounds.max_metrics))
            for metric in sm.metrics[:]:  # a slice (a list) is cheaper to walk than upb's container
                _translate_metric(metric, batch, received_ns, limits, client, resource_labels, bounds)
    return batch


IDENTITY_MISMATCH = "identity_mismatch"


def _in_pod(labels: Labels, uid: str) -> Labels:
    """A pod's resource with ``k8s.pod.uid`` set to the pod's own (``Peer.pod``): whatever it claimed, its
    ``process.pid`` can then only name a process of that pod (``core.procinfo.ProcessIdentity.matches``)."""
    return tuple(sorted([(k, v) for k, v in labels if k != LABEL_POD_UID] + [(LABEL_POD_UID, uid)]))


def _reject_resource(rm: Any, batch: Batch, why: str) -> None:
    """Count every data point of a resource as rejected for ``why`` (its claims contradict its peer)."""
    n = 0
    for sm in rm.scope_metrics[:]:
        for metric in sm.metrics[:]:
            data = metric.WhichOneof("data")
            if data is not None:
                n += len(getattr(metric, data).data_points)
    batch.received += n
    batch.reject(IDENTITY_MISMATCH, n, why)


#: Translated resource attributes by the resource's bytes (every export of a process repeats them).
_RESOURCE_CACHE: dict[tuple[int, int, bytes], Labels] = {}


def _resource_labels(resource: Any, limits: Limits) -> Labels:
    """The resource's labels, () when its attributes break a limit (cached like ``_point_labels``)."""
    raw = resource.SerializeToString()
    key = (limits.max_label_length, limits.max_labels_per_point, raw)
    out = _RESOURCE_CACHE.get(key)
    if out is None:
        try:
            out = translate_labels(resource.attributes, limits=limits)
        except _Rejected:
            out = ()
        if len(raw) <= 2 * _ATTRS_KEY_MAX:
            remember(_RESOURCE_CACHE, key, out, _ATTRS_CACHE_MAX)
    return out


#: What a metric's envelope translates to or its rejection (reason, message), by everything it depends on: a
#: trainer sends the same envelopes on every export. A translation is (kind, name, help, unit, reserved labels,
#: delta, the head of its points' ``_ATTRS_CACHE`` keys, ``series_cost`` of a scalar series with no labels, the
#: bit of the training contract's label set its points must fit, 0 when it is no contract family: ``otlp.reserved``).
_Descriptor = tuple[Kind, str, str, str, tuple[str, ...], bool, tuple[object, ...], int, int] | tuple[str, str]
_DESCRIPTOR_CACHE: dict[tuple[object, ...], _Descriptor] = {}
_DESCRIPTOR_CACHE_MAX = 1024
_isfinite = math.isfinite


def _translate_metric(metric: Any, batch: Batch, received_ns: int, limits: Limits, client: str = "",
                      resource: Labels = (), bounds: RequestLimits = DEFAULT_REQUEST_LIMITS) -> None:
    data = metric.WhichOneof("data")
    if data is None:
        return  # an empty envelope carries no points
    container = getattr(metric, data)
    points = container.data_points
    n = len(points)
    batch.received += n
    batch.made += n * census.POINT_MADE
    if batch.received > bounds.max_points or batch.made > bounds.max_made_bytes:
        raise TooMuch(bounds.refusal(batch.received, batch.made))
    max_made = bounds.max_made_bytes
    if n == 0:
        return
    otel_name, unit, description = metric.name, metric.unit, metric.description
    if data == "sum":
        key: tuple[object, ...] = (data, otel_name, unit, description, limits.max_label_length,
                                   limits.max_labels_per_point, container.aggregation_temporality,
                                   container.is_monotonic)
    elif data == "gauge":
        key = (data, otel_name, unit, description, limits.max_label_length, limits.max_labels_per_point,
               _metadata_type(metric) if len(getattr(metric, "metadata", ())) else "")
    elif data == "histogram":
        key = (data, otel_name, unit, description, limits.max_label_length, limits.max_labels_per_point,
               container.aggregation_temporality)
    else:
        key = (data, otel_name, unit, description, limits.max_label_length, limits.max_labels_per_point)
    desc = _DESCRIPTOR_CACHE.get(key)
    if desc is None:
        desc = _describe(metric, data, container, limits)
        if len(otel_name) + len(unit) + len(description) <= 4 * _CACHE_KEY_MAX:
            remember(_DESCRIPTOR_CACHE, key, desc, _DESCRIPTOR_CACHE_MAX)
    if len(desc) == 2:
        _check_attributes(points)
        batch.reject(desc[0], n, desc[1])
        return
    kind, prom_name, help_text, family_unit, reserved, delta, key_head, base_cost, contract_bit = desc
    # the points, in this function rather than one more call per metric (most metrics carry one point)
    latest = received_ns + limits.max_future_skew_ns
    max_cost = limits.max_series_bytes
    append = batch.points.append
    cached = _ATTRS_CACHE.get
    max_labels = limits.max_labels_per_point
    distribution = kind == "histogram" or kind == "summary"
    counter = kind == "counter"
    for dp in points[:]:
        try:
            attributes = dp.attributes
            # _point_labels, its cache looked up here first (one call less per point; the slice is cheaper
            # than unpacking upb's container)
            hit = cached((*key_head, *attributes[:])) if len(attributes) <= max_labels else None
            if hit is None:
                hit = _point_labels(attributes, reserved, limits)
                batch.made += census.LABEL_MADE * len(hit[0])  # a new label set: its strings and tuples
                if batch.made > max_made:
                    raise TooMuch(bounds.refusal(batch.received, batch.made))
            labels, run_id, label_chars, fits = hit
            if contract_bit and not fits & contract_bit:
                raise _Rejected(reserved_names.REASON, reserved_names.label_refusal(prom_name, labels) or "")
            time_ns = dp.time_unix_nano or received_ns
            start_ns = dp.start_time_unix_nano
            if time_ns > latest or start_ns > latest:
                ahead = (max(time_ns, start_ns) - received_ns) / 1e9
                raise _Rejected("future_timestamp", f"timestamp {ahead:.0f} s after the request arrived, more "
                                f"than {limits.max_future_skew_ns / 1e9:g} s (--otlp.max-future-skew); "
                                "check the sender's clock")
            if dp.flags & FLAG_NO_RECORDED_VALUE:
                append(Point(kind, prom_name, help_text, family_unit, labels, run_id, start_ns, time_ns, delta,
                             no_value=True, client=client, resource=resource))
                continue
            if distribution:
                point = Point(kind, prom_name, help_text, family_unit, labels, run_id, start_ns, time_ns, delta,
                              client=client, resource=resource)
                _fill_distribution(point, dp, limits, label_chars)
                batch.made += census.VALUE_MADE * (len(point.counts) + len(point.bounds) + 2 * len(point.quantiles))
                if batch.made > max_made:
                    raise TooMuch(bounds.refusal(batch.received, batch.made))
                cost = point.cost
            else:
                which = dp.WhichOneof("value")
                if which == "as_double":
                    value = dp.as_double
                elif which == "as_int":
                    value = float(dp.as_int)
                else:
                    raise _Rejected("invalid_point", "data point has no value")
                if counter:
                    if not _isfinite(value):
                        raise _Rejected("non_finite", f"counter value {value!r}: counters must be finite "
                                        "(a non-finite total could never be counted on from)")
                    if value < 0:
                        raise _Rejected("invalid_point", f"invalid counter value {value!r}")
                cost = base_cost + 4 * label_chars  # series_cost(prom_name, label_chars, kind): linear in it
                # every field by position (Point's order): keywords cost more per point
                point = Point(kind, prom_name, help_text, family_unit, labels, run_id, start_ns, time_ns, delta,
                              value, cost, client, resource)
            if cost > max_cost:
                raise _Rejected("series_too_large", f"series of about {cost} bytes, more than "
                                f"{limits.max_series_bytes} (--otlp.max-series-bytes); use fewer or shorter "
                                "labels, buckets or quantiles")
        except _Rejected as exc:
            batch.reject(exc.reason, 1, f"metric {otel_name[:200]!r}: {exc.message}")
            continue
        append(point)


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
    squat = reserved_names.family_refusal(prom_name, kind, otel_name)
    if squat is not None:
        return squat
    help_text = metric.description[:MAX_HELP_LENGTH] or f"{otel_name} (received over OTLP)"
    family_unit = _family_unit(prom_name, kind, _cached_unit(unit))
    reserved = ("le",) if kind == "histogram" else ("quantile",) if kind == "summary" else ()
    return (kind, prom_name, help_text, family_unit, reserved, delta,
            (reserved, limits.max_label_length, limits.max_labels_per_point), series_cost(prom_name, 0, kind),
            reserved_names.family_bit(prom_name))
