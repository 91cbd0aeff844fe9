"""A direct exposition encoder: the bytes ``prometheus_client`` would write, without its per-family machinery.

``prometheus_client.exposition.generate_latest`` (text 0.0.4) and its OpenMetrics twin cost about 10 µs
per sample: they re-validate and re-escape every label name and value of every sample on every call. The
scrape path encodes what changed only, but a full re-push of 1,000 training series made it encode 2,500
samples per scrape. This module writes the same bytes from parts prepared once:

- ``sample_head(name, labels, openmetrics)`` is everything of a sample line before the value
  (``name{k="v",...} ``): built once per series (labels never change for a series);
- ``go_float(value)`` is the value exactly as ``prometheus_client.utils.floatToGoString`` writes it;
- ``encode_families`` encodes ``Metric`` objects (the receiver's self-metrics, ``target_info``) the same way
  and hands anything it does not cover (timestamps, exemplars, native histograms, ``_created`` /
  ``_gsum`` / ``_gcount`` samples, names outside the legacy character set) to ``prometheus_client``.

Label values are escaped as ``prometheus_client`` does (backslash, newline and double quote; any other
character, unicode included, is written as is). Sample names with ``:`` are written as is in the text
format and with ``_`` in OpenMetrics (``prometheus_client``'s OpenMetrics sample escaping); label names are
always legacy names here (translation sanitises them), others go to ``prometheus_client``.
``tests/test_encoder.py`` compares every path with ``prometheus_client``'s output byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from prometheus_client.core import Metric

from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.core.metrics import MetricSpec

_LEGACY_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_LEGACY_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_OM_EOF = b"# EOF\n"
#: Sample-name suffixes that prometheus_client's text encoder moves into a family of their own.
_SPECIAL_SUFFIXES = ("_created", "_gsum", "_gcount")
_HEADER_CACHE: dict[tuple[str, str, str, str, bool], bytes] = {}
_HEADER_CACHE_MAX = 4096


def go_float(d: float) -> str:
    """``prometheus_client.utils.floatToGoString``, same output for every float (and int)."""
    if type(d) is not float:
        d = float(d)
    s = repr(d)
    last = s[-1]
    if last == "f":  # inf, -inf
        return "+Inf" if d > 0 else "-Inf"
    if last == "n":  # nan
        return "NaN"
    if d > 0:
        dot = s.find(".")
        # Go switches to exponents sooner than Python (only for positive values, as prometheus_client does).
        if dot > 6:
            mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
            return f"{mantissa}e+{dot - 1:02d}"
    return s


def escape_value(value: str) -> str:
    """A label value as prometheus_client escapes it (both formats)."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def legacy_labels(labels: Iterable[tuple[str, str]]) -> bool:
    return all(_LEGACY_LABEL.match(k) for k, _ in labels)


def legacy_name(name: str) -> bool:
    return _LEGACY_METRIC.match(name) is not None


def sample_name(name: str, openmetrics: bool) -> str:
    """The sample name as written (a legacy metric name; OpenMetrics samples write ``:`` as ``_``)."""
    return name.replace(":", "_") if openmetrics else name


def sample_head(name: str, labels: Sequence[tuple[str, str]], openmetrics: bool) -> bytes:
    """``name{k="v",...} `` for a legacy ``name`` and legacy label names (``labels`` in any order)."""
    name = sample_name(name, openmetrics)
    if not labels:
        return (name + " ").encode("utf-8")
    inner = ",".join(f'{k}="{escape_value(v)}"' for k, v in sorted(labels))
    return f"{name}{{{inner}}} ".encode()


def lines(heads: Sequence[bytes], values: Sequence[float]) -> bytes:
    """Sample lines from their heads and values."""
    if len(heads) == 1:
        return heads[0] + go_float(values[0]).encode("ascii") + b"\n"
    return b"".join([h + go_float(v).encode("ascii") + b"\n" for h, v in zip(heads, values, strict=True)])


def fallback(families: Iterable[Metric], openmetrics: bool) -> bytes:
    """prometheus_client's own encoding (OpenMetrics without its ``# EOF``)."""
    # imported here: prometheus_client.exposition brings http.server, urllib.request, ssl and wsgiref (about
    # 10 MB of a daemon's memory) for what only the rare families this module does not cover need
    from prometheus_client import exposition as text_exposition
    from prometheus_client.openmetrics import exposition as om_exposition

    registry = _Families(list(families))
    if openmetrics:
        body = om_exposition.generate_latest(registry)
        return body[: -len(_OM_EOF)] if body.endswith(_OM_EOF) else body
    return text_exposition.generate_latest(registry)


def header(metric: Metric, openmetrics: bool) -> bytes:
    """The family's ``# HELP`` / ``# TYPE`` (/ ``# UNIT``) lines, cached (families repeat every scrape)."""
    key = (metric.name, metric.type, metric.documentation, metric.unit, openmetrics)
    out = _HEADER_CACHE.get(key)
    if out is None:
        out = _direct_header(metric, openmetrics)
        if out is None:
            empty = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out = fallback([empty], openmetrics)
        remember(_HEADER_CACHE, key, out, _HEADER_CACHE_MAX)
    return out


_PLAIN_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
#: prometheus_client's munging of OpenMetrics types into the text format: (name suffix, type written)
_TEXT_TYPES = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
               "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}


def _direct_header(metric: Metric, openmetrics: bool) -> bytes | None:
    """``header`` written here for plain names (no ``:``, nothing to escape), as prometheus_client writes it;
    None for any other name (prometheus_client's exposition module writes those)."""
    if not _PLAIN_NAME.match(metric.name):
        return None
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        name, doc = metric.name, doc.replace('"', r'\"')
        unit = f"# UNIT {name} {metric.unit}\n" if metric.unit else ""
        return f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n{unit}".encode()
    suffix, mtype = _TEXT_TYPES.get(metric.type, ("", metric.type))
    name = metric.name + suffix
    return f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n".encode()


#: (family name, sample name, labels as given, format) -> the sample's head; None: not for the direct path
_HEAD_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...], bool], bytes | None] = {}
_HEAD_CACHE_MAX = 8192


def _head(family: str, name: str, labels: tuple[tuple[str, str], ...], openmetrics: bool) -> bytes | None:
    """A sample's head, cached (the same series come back every scrape: self-metrics, sample ages); None for
    a sample ``encode_families`` leaves to prometheus_client (special suffixes, names outside the legacy set)."""
    key = (family, name, labels, openmetrics)
    try:
        return _HEAD_CACHE[key]
    except KeyError:
        pass
    head = None
    if name not in (family + "_created", family + "_gsum", family + "_gcount") and legacy_name(name) \
            and legacy_labels(labels):
        head = sample_head(name, labels, openmetrics)
    remember(_HEAD_CACHE, key, head, _HEAD_CACHE_MAX)  # bounded: churning label values (run ids) must not grow it
    return head


def _direct(metric: Metric, openmetrics: bool) -> list[bytes] | None:
    """The family's sample lines when ``encode_families`` can write them itself, else None."""
    if not legacy_name(metric.name):
        return None
    out = []
    for s in metric.samples:
        if s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None:
            return None
        head = _head(metric.name, s.name, tuple(s.labels.items()), openmetrics)
        if head is None:
            return None
        out.append(head + go_float(s.value).encode("ascii") + b"\n")
    return out


def encode_families(families: Iterable[Metric], openmetrics: bool) -> bytes:
    """What prometheus_client's ``generate_latest`` gives for ``families`` (OpenMetrics without ``# EOF``)."""
    out: list[bytes] = []
    for metric in families:
        lines = _direct(metric, openmetrics)
        if lines is None:
            out.append(fallback([metric], openmetrics))
            continue
        out.append(header(metric, openmetrics))
        out.extend(lines)
    return b"".join(out)


#: (spec name, format) -> (the family's header, {label values: sample head}) for ``encode_spec``
_SPEC_TEXT: dict[tuple[str, bool], tuple[bytes, dict[tuple[str, ...], bytes]]] = {}


def encode_spec(spec: MetricSpec, rows: Iterable[tuple[Sequence[str], float]], openmetrics: bool) -> bytes:
    """``encode_families([fam], openmetrics)`` for a gauge or counter ``fam = spec.family()`` with
    ``metrics.add(fam, labels, value)`` for each row: the same bytes, from a header and sample heads cached by
    label values (for families encoded on every scrape, such as the receiver's self-metrics)."""
    key = (spec.name, openmetrics)
    text = _SPEC_TEXT.get(key)
    if text is None:
        text = _SPEC_TEXT[key] = (header(spec.family(), openmetrics), {})
    head_of = text[1]
    out = [text[0]]
    for values, value in rows:
        head = head_of.get(tuple(values))
        if head is None:
            head = remember(head_of, tuple(values),
                            sample_head(spec.name, tuple(zip(spec.labels, values, strict=True)), openmetrics),
                            _HEAD_CACHE_MAX)
        out += (head, go_float(value).encode("ascii"), b"\n")
    return b"".join(out)


class _Families:
    """The minimal registry interface prometheus_client's encoders need."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


# ----------------------------------------------------------------------------------------------------
# content negotiation

TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
TEXT_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"
OPENMETRICS_1_0_0 = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_ESCAPINGS = frozenset({"allow-utf-8", "underscores", "dots", "values"})


def _param(tokens: Sequence[str], key: str) -> str:
    for tok in tokens:
        if "=" in tok:
            k, v = tok.strip().split("=", 1)
            if k == key:
                return v
    return ""


def _at_least_1(version: str) -> bool:
    parts: list[int | str] = []
    for part in version.split("."):
        try:
            parts.append(int(part))
        except ValueError:
            parts.append(part)
    try:
        return tuple(parts) >= (1, 0, 0)
    except TypeError:  # "1.x": prometheus_client raises here; such a header gets the default format
        return False


def content_type(accept: str) -> str:
    """The Content-Type ``prometheus_client.exposition.choose_encoder`` picks for an ``Accept`` header
    (OpenMetrics or the text format, with the ``escaping`` it names), decided without importing that module
    (it brings http.server, urllib.request and ssl). ``tests/test_encoder.py`` checks both agree."""
    for accepted in (accept or "").split(","):
        tokens = accepted.split(";")
        media = tokens[0].strip()
        if media not in ("application/openmetrics-text", "text/plain"):
            continue
        version = _param(tokens, "version")
        escaping = _param(tokens, "escaping")
        escaping = escaping if escaping in _ESCAPINGS else "underscores"
        if media == "application/openmetrics-text":
            if not version:
                return OPENMETRICS_1_0_0
            if _at_least_1(version):
                return f"application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}"
        elif version and _at_least_1(version):
            return f"{TEXT_1_0_0}; escaping={escaping}"
    return TEXT_0_0_4
