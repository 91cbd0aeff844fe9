"""OpenTelemetry names and attribute values as Prometheus names and label values: pure functions on strings.

``metric_name``, ``unit_name``, ``label_name`` and ``attribute_value`` translate single names and values
exactly as the OpenTelemetry "Prometheus and OpenMetrics Compatibility" rules give them, in the flavour that
Prometheus's own OTLP receiver applies with ``otlp.translation_strategy: UnderscoreEscapingWithSuffixes``
(``github.com/prometheus/otlptranslator``) and the Collector's prometheus exporter
(``pkg/translator/prometheus``), so a dashboard written against either works unchanged against this
exporter. The pusher (``otlp.conventions.own_name``), docgen and the dashboards builder use the same rules.

Choices where the implementations and the spec text differ (each follows the reference implementations,
because dashboard compatibility is the goal):

- Label names are not collapsed (``a..b`` gives ``a__b``): the spec says multiple underscores MUST be
  collapsed, but Prometheus (``label_name_preserve_multiple_underscores: true`` by default) and the
  Collector both keep them. Leading digits give ``key_1x``, a single leading underscore ``key_x``.

This module holds no state (no caches: ``otlp.translate`` keeps those), never applies a limit and never
imports anything beyond the standard library.
"""

from __future__ import annotations

import base64
import json
import math
import re
from decimal import Decimal
from typing import Any, Literal

#: How a metric is classified for naming (otlptranslator's MetricType): only "counter" gets ``_total``
#: and only "gauge" gets ``_ratio`` for unit "1"; "updown" (non-monotonic sum) gets neither.
NameKind = Literal["counter", "gauge", "updown", "histogram", "summary", "unknown"]

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

