"""The training store's families and series, and how they are written as exposition lines: the sample
heads (``name{labels} ``) built once per label set and layout, the encoded lines, the family's header, and
``prometheus_client`` samples for ``collect()``.

A ``Series`` is a folding ``Stream`` (``otlp.folding``) with its labels, its cost in the store's bytes and
its encoding caches; a ``Family`` holds the series of one metric name and the names its exposition claims.
Plain objects and pure functions: this module never takes a lock (the store's lock guards every mutable
field here), never starts a thread, never decides admission or expiry, and never reads a clock.
"""

from __future__ import annotations

from types import MappingProxyType

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from gpu_energy_exporter.core import encoder
from gpu_energy_exporter.otlp.folding import Stream, layout
from gpu_energy_exporter.otlp.points import Kind, Labels

#: A series' sample heads, [text, OpenMetrics] (one tuple twice unless the name has a ':').
Heads = tuple[tuple[bytes, ...], tuple[bytes, ...]]
#: What a push changed, to encode after the lock is released: (series, its heads, its exposed values).
Changed = tuple["Series", Heads, tuple[float, ...]]


class Series(Stream):
    """One metric + label set: its folding state (``Stream``), labels, cost and encoded lines."""

    __slots__ = ("labels", "run_id", "last_seen", "layout", "heads", "values", "enc", "cost", "view")

    def __init__(self, labels: dict[str, str], run_id: str, cost: int) -> None:
        super().__init__()
        self.labels = labels
        self.view = MappingProxyType(labels)  # read-only labels for listeners
        self.run_id = run_id
        self.cost = cost
        self.last_seen = 0.0
        # What the sample lines look like: ``layout`` (bucket bounds and whether there is a _sum, quantiles)
        # gives ``heads``, [text, OpenMetrics] (one tuple twice unless the name has a ':'), each one
        # ``name{labels} `` per sample.
        self.layout: object = None
        self.heads: Heads = ((), ())
        # the exposed values (a new tuple at every change: the identity is the version) and the encoded
        # lines [text, OpenMetrics], each (the values it encodes, bytes), valid while ``enc[k][0] is values``
        self.values: tuple[float, ...] = ()
        self.enc: list[tuple[tuple[float, ...], bytes] | None] = [None, None]


class Family:
    """The series of one metric name, its metadata, the names its exposition claims and its cached lines."""

    __slots__ = ("name", "kind", "help", "unit", "series", "claims", "header", "cost", "gen", "block")

    def __init__(self, name: str, kind: Kind, help: str, unit: str) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.unit = unit
        self.series: dict[Labels, Series] = {}
        self.claims = claimed_names(name, kind)
        self.header: list[bytes | None] = [None, None]  # encoded # HELP / # TYPE / # UNIT lines
        self.cost = family_bytes(name, help)
        # ``gen`` changes with any of its series (lock held); ``block`` [text, OpenMetrics]: (gen, the
        # family's encoded header and lines) for the render of an unchanged family
        self.gen = 0
        self.block: list[tuple[int, bytes] | None] = [None, None]


def family_bytes(name: str, help: str) -> int:
    """Estimated bytes of a family apart from its series (help and names, the cached headers)."""
    return 8 * (len(name) + 8) + 4 * len(help) + 1024


def claimed_names(name: str, kind: Kind) -> tuple[str, ...]:
    """Every name a family's exposition uses, in either format (family names and sample names)."""
    if kind == "counter":
        base = name[: -len("_total")]
        return (base, name, base + "_created")
    if kind == "histogram":
        return (name, name + "_bucket", name + "_count", name + "_sum", name + "_created")
    if kind == "summary":
        return (name, name + "_count", name + "_sum", name + "_created")
    return (name,)


#: a series' ready lines, or (series, its heads in the format, values) to encode them from
Part = bytes | tuple[Series, tuple[bytes, ...], tuple[float, ...]]

TARGET_INFO = Metric("target", "Resource attributes of the processes pushing OTLP metrics "
                     "(one series per resource; never job/instance).", "info")


def encode_changed(changed: list[Changed]) -> None:
    """Encode the series a request changed, from the heads and values taken under the lock (after it is
    released; a racing push stores its own encoding, and the store's ``render`` checks which one is current)."""
    for s, heads, values in changed:
        text = encode_lines(heads[0], values)
        entry = (values, text)
        if heads[1] is heads[0]:
            s.enc = [entry, entry]
        else:
            s.enc = [entry, (values, encode_lines(heads[1], values))]


#: ``encoder.go_float(value)`` as the end of a sample line, by value: values repeat (a histogram's buckets
#: above the one its observations fall in, constant gauges). Zero is not kept (0.0 and -0.0 are one key with
#: two texts), nor NaN (never equal to itself). Bounded: cleared when full.
_VALUE_TEXT: dict[float, bytes] = {}
_VALUE_TEXT_MAX = 4096


def encode_lines(heads: tuple[bytes, ...], values: tuple[float, ...]) -> bytes:
    """``encoder.lines(heads, values)``, the same bytes, with the values' text cached."""
    if len(heads) == 1:
        return heads[0] + _text(values[0])
    return b"".join([head + _text(v) for head, v in zip(heads, values, strict=True)])


def _text(v: float) -> bytes:
    text = _VALUE_TEXT.get(v) if v else None
    if text is None:
        text = encoder.go_float(v).encode("ascii") + b"\n"
        if v and v == v:
            if len(_VALUE_TEXT) >= _VALUE_TEXT_MAX:
                _VALUE_TEXT.clear()
            _VALUE_TEXT[v] = text
    return text


#: What a render takes of a family under the store's lock: its cached block, or (the family, its generation,
#: header, parts) to join after the lock is released.
Ready = bytes | tuple[Family, int, bytes, list[Part]]


def ready(fam: Family, openmetrics: bool) -> Ready:
    """References only (the store's lock held): the family's block when unchanged, else its header and each
    series' ready lines or what to encode them from."""
    k = 1 if openmetrics else 0
    block = fam.block[k]
    if block is not None and block[0] == fam.gen:
        return block[1]
    header = fam.header[k]
    if header is None:
        header = fam.header[k] = encode_header(fam, openmetrics)
    parts: list[Part] = []
    for s in fam.series.values():
        enc = s.enc[k]
        values = s.values
        parts.append(enc[1] if enc is not None and enc[0] is values else (s, s.heads[k], values))
    return (fam, fam.gen, header, parts)


def join(item: Ready, openmetrics: bool) -> bytes:
    """A family's lines (after the lock is released): encodes any series whose encoding a racing push has
    not stored yet, and keeps the block for the next render of the unchanged family."""
    if isinstance(item, bytes):
        return item
    k = 1 if openmetrics else 0
    fam, gen, header, parts = item
    lines: list[bytes] = [header]
    for part in parts:
        if isinstance(part, tuple):
            s, heads, values = part
            part = encode_lines(heads, values)
            s.enc[k] = (values, part)  # one reference store: atomic; stale if the series changed since
        lines.append(part)
    joined = b"".join(lines)
    fam.block[k] = (gen, joined)
    return joined


def encode_header(fam: Family, openmetrics: bool) -> bytes:
    return encoder.fallback([metric(fam, ())], openmetrics)


def metric(fam: Family, samples: tuple[Sample, ...]) -> Metric:
    """The family as a prometheus_client ``Metric`` with ``samples``."""
    name = fam.name[: -len("_total")] if fam.kind == "counter" else fam.name
    metric = Metric(name, fam.help, fam.kind, fam.unit)
    metric.samples.extend(samples)
    return metric


def relayout(fam: Family, s: Series) -> None:
    """Build the series' sample heads when they are new or its layout changed (lock held)."""
    new = layout(fam.kind, s)
    if new == s.layout:
        return
    s.layout = new
    text = _heads(fam, s, False)
    s.heads = (text, text if ":" not in fam.name else _heads(fam, s, True))


def _heads(fam: Family, s: Series, openmetrics: bool) -> tuple[bytes, ...]:
    name, kind = fam.name, fam.kind
    labels = tuple(s.labels.items())
    if kind == "histogram":
        bucket = name + "_bucket"
        heads = [encoder.sample_head(bucket, (*labels, ("le", encoder.go_float(b))), openmetrics)
                 for b in s.bounds]
        heads.append(encoder.sample_head(bucket, (*labels, ("le", "+Inf")), openmetrics))
        heads.append(encoder.sample_head(name + "_count", labels, openmetrics))
        if s.has_sum:
            heads.append(encoder.sample_head(name + "_sum", labels, openmetrics))
        return tuple(heads)
    if kind == "summary":
        heads = [encoder.sample_head(name, (*labels, ("quantile", encoder.go_float(q))), openmetrics)
                 for q, _ in s.quantiles]
        heads.append(encoder.sample_head(name + "_count", labels, openmetrics))
        heads.append(encoder.sample_head(name + "_sum", labels, openmetrics))
        return tuple(heads)
    return (encoder.sample_head(name, labels, openmetrics),)


def samples(fam: Family, s: Series) -> tuple[Sample, ...]:
    """The series as prometheus_client samples (``collect()``; the scrape path uses the encoded lines)."""
    name, kind, labels = fam.name, fam.kind, s.labels
    values = s.values
    if kind == "histogram":
        bucket = name + "_bucket"
        out = [Sample(bucket, {**labels, "le": encoder.go_float(b)}, v)
               for b, v in zip(s.bounds, values, strict=False)]
        out.append(Sample(bucket, {**labels, "le": "+Inf"}, values[len(s.bounds)]))
        out.append(Sample(name + "_count", labels, values[len(s.bounds) + 1]))
        if s.has_sum:
            out.append(Sample(name + "_sum", labels, values[-1]))
        return tuple(out)
    if kind == "summary":
        out = [Sample(name, {**labels, "quantile": encoder.go_float(q)}, v)
               for (q, _), v in zip(s.quantiles, values, strict=False)]
        out.append(Sample(name + "_count", labels, s.raw_count))
        out.append(Sample(name + "_sum", labels, s.raw_sum))
        return tuple(out)
    return (Sample(name, labels, values[0]),)
