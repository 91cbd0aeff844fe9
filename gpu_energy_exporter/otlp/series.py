"""The training store's families and series, and how they are written as exposition lines: the sample
heads (``name{labels} ``) built once per label set and layout, the encoded lines, the family's header, and
``prometheus_client`` samples for ``collect()``.

A ``Series`` is a folding ``Stream`` (``otlp.temporality``) with its labels, its cost in the store's bytes and
its sample heads; a ``Family`` holds the series of one metric name (a ``SeriesMap``: the series and, in the
same order, their encoded lines) and the names its exposition claims.

How a render stays a copy of references: the pushing thread encodes what its request changed after the
store's lock is released (``encode_changed``), then stores the lines in the family's list under the lock
(``publish``: one list item per series, only if no newer push changed the series since). A render takes each
changed family's list (a C copy of references) and joins it after the lock is released; it never visits a
series. A series added or removed takes or frees its place in the list as the store adds or deletes it.
Plain objects and pure functions: this module never takes a lock (the store's lock guards every mutable
field here), never starts a thread, never decides admission or expiry, and never reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from gpu_energy_exporter.core import encoder
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.otlp.points import Kind, Labels
from gpu_energy_exporter.otlp.temporality import Stream, layout

#: A series' sample heads, [text, OpenMetrics] (one tuple twice unless the name has a ':').
Heads = tuple[tuple[bytes, ...], tuple[bytes, ...]]
#: What a push changed, to encode after the lock is released: (series, its heads, its exposed values).
Changed = tuple["Series", Heads, tuple[float, ...]]


class Series(Stream):
    """One metric + label set: its folding state (``Stream``), labels, cost and encoded lines."""

    __slots__ = ("labels", "run_id", "last_seen", "layout", "heads", "values", "cost", "view", "home", "pos",
                 "identity", "principal")

    def __init__(self, labels: dict[str, str], run_id: str, cost: int, identity: str = "", principal: str = "") -> None:
        super().__init__()
        self.labels = labels
        # who created it (``core.clientid``): its quota counts the series; another principal may not write it
        self.identity = identity
        self.principal = principal
        self.view = MappingProxyType(labels)  # read-only labels for listeners
        self.run_id = run_id
        self.cost = cost
        self.last_seen = 0.0
        # What the sample lines look like: ``layout`` (bucket bounds and whether there is a _sum, quantiles)
        # gives ``heads``, [text, OpenMetrics] (one tuple twice unless the name has a ':'), each one
        # ``name{labels} `` per sample.
        self.layout: object = None
        self.heads: Heads = ((), ())
        # the exposed values (a new tuple at every change: the identity is the version)
        self.values: tuple[float, ...] = ()
        # where its encoded lines are: the ``SeriesMap`` holding it and its index in the map's lines
        self.home: SeriesMap | None = None
        self.pos = -1


class SeriesMap(dict[Labels, "Series"]):
    """A family's series by labels, in insertion order (the exposition's order), and their encoded lines in
    the same order: ``lines`` [text, OpenMetrics] (one list twice unless the name has a ':'), a series' lines
    at its ``pos`` (None until its first encoding is published, or where a removed series was). ``version``
    changes whenever a list changes (the key of the family's cached block). The store's lock guards all of it.

    Adding and deleting a series (``m[k] = s``, ``del m[k]``, the only mutations the store makes) keep the
    lists in step: an added series takes the next place, a deleted one leaves a hole, and the lists are
    compacted when holes are more than half of them (bounded, amortised O(1) per deletion)."""

    __slots__ = ("lines", "holes", "version")

    def __init__(self, split: bool) -> None:
        super().__init__()
        text: list[bytes | None] = []
        self.lines: tuple[list[bytes | None], list[bytes | None]] = (text, [] if split else text)
        self.holes = 0
        self.version = 0

    def __setitem__(self, key: Labels, s: Series) -> None:
        old = self.get(key)
        if old is not None:  # a replacement keeps the key's place (the store never does this)
            s.pos, old.pos, old.home = old.pos, -1, None
            for lines in self._formats():
                lines[s.pos] = None
        else:
            s.pos = len(self.lines[0])
            for lines in self._formats():
                lines.append(None)
        s.home = self
        dict.__setitem__(self, key, s)
        self.version += 1

    def __delitem__(self, key: Labels) -> None:
        s = self[key]
        dict.__delitem__(self, key)
        for lines in self._formats():
            lines[s.pos] = None
        s.home, s.pos = None, -1
        self.holes += 1
        self.version += 1
        if self.holes > 8 and 2 * self.holes > len(self.lines[0]):
            self._compact()

    def _formats(self) -> tuple[list[bytes | None], ...]:
        text, om = self.lines
        return (text,) if om is text else (text, om)

    def _compact(self) -> None:
        old = self.lines
        text = [old[0][s.pos] for s in self.values()]
        om = text if old[1] is old[0] else [old[1][s.pos] for s in self.values()]
        for i, s in enumerate(self.values()):
            s.pos = i
        self.lines = (text, om)
        self.holes = 0


class Family:
    """The series of one metric name, its metadata, the names its exposition claims and its cached lines."""

    __slots__ = ("name", "kind", "help", "unit", "series", "claims", "header", "cost", "gen", "block")

    def __init__(self, name: str, kind: Kind, help: str, unit: str) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.unit = unit
        self.series = SeriesMap(":" in name)
        self.claims = claimed_names(name, kind)
        self.header: list[bytes | None] = [None, None]  # encoded # HELP / # TYPE / # UNIT lines
        self.cost = family_bytes(name, help)
        # ``gen`` changes with any of its series (lock held; no reader since the render keys its block on the
        # lines' version); ``block`` [text, OpenMetrics]: (the series' lines ``version``, the family's
        # encoded header and lines) for the render of an unchanged family
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


TARGET_INFO = Metric("target", "Resource attributes of the processes pushing OTLP metrics "
                     "(one series per resource; never job/instance).", "info")

def target_info_families(resources: Iterable[dict[str, str]]) -> list[Metric]:
    """``target_info`` with one sample per resource's labels (none when there is no resource)."""
    info = Metric(TARGET_INFO.name, TARGET_INFO.documentation, "info")
    info.samples.extend(Sample("target_info", labels, 1.0) for labels in resources)
    return [info] if info.samples else []


#: A series' new lines, to publish: (series, the values they encode, text lines, OpenMetrics lines).
Encoded = tuple["Series", tuple[float, ...], bytes, bytes]


def encode_changed(changed: list[Changed]) -> list[Encoded]:
    """Encode the series a request changed, from the heads and values taken under the lock (after it is
    released); ``publish`` stores them."""
    out: list[Encoded] = []
    for s, heads, values in changed:
        text = encode_lines(heads[0], values)
        out.append((s, values, text, text if heads[1] is heads[0] else encode_lines(heads[1], values)))
    return out


def publish(encoded: list[Encoded]) -> None:
    """Store encoded lines in their families' lists (the store's lock held): only lines of a series' current
    values, so a request that encoded after a newer push to the same series never stores older bytes over
    newer ones (the last push to change a series always finds its values current)."""
    for s, values, text, om in encoded:
        home = s.home
        if home is None or s.values is not values:
            continue  # removed, or changed again since (that push publishes its own lines)
        pos = s.pos
        lines = home.lines
        lines[0][pos] = text
        lines[1][pos] = om
        home.version += 1


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
            remember(_VALUE_TEXT, v, text, _VALUE_TEXT_MAX)
    return text


#: What a render takes of a family under the store's lock: its cached block, or (the family, the lines'
#: version, its header, a copy of its lines list) to join after the lock is released.
Ready = bytes | tuple[Family, int, bytes, list[bytes | None]]


def ready(fam: Family, openmetrics: bool) -> Ready:
    """References only (the store's lock held): the family's block when unchanged, else its header and a
    copy of its lines list."""
    k = 1 if openmetrics else 0
    block = fam.block[k]
    version = fam.series.version
    if block is not None and block[0] == version:
        return block[1]
    header = fam.header[k]
    if header is None:
        header = fam.header[k] = encode_header(fam, openmetrics)
    return (fam, version, header, fam.series.lines[k].copy())


def join(item: Ready, openmetrics: bool) -> bytes:
    """A family's header and lines (after the lock is released; holes and series not published yet left
    out), kept as its block for the next render while the lines do not change."""
    if isinstance(item, bytes):
        return item
    fam, version, header, lines = item
    joined = b"".join([header, *filter(None, lines)])
    fam.block[1 if openmetrics else 0] = (version, joined)
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
