"""What an OTLP request would make, counted before it is made: the receiver's memory is bounded by what
decoding builds, not by the bytes on the wire.

Why: the protobuf parser spends 30 to 80 bytes on a message however few bytes it takes on the wire (an empty
``ResourceMetrics`` is two bytes, ``0a 00``), and the translation a few hundred bytes on a point, its labels
and its buckets. 8 MiB of empty resources (8 KB gzip'd) took the exporter from 29 MB to 2.5 GB.

Two budgets, both derived from ``--otlp.max-points-per-request`` (``RequestLimits``):

- What the parse makes (``max_decoded_bytes``): before a body is parsed, ``census`` walks its wire format
  (tags and lengths; nothing is built) and estimates what the parse would allocate: ``MESSAGE_BYTES`` a message,
  ``ENTRY_BYTES`` a repeated string or attribute, ``VARINT_BYTES`` a varint of a packed list, following OTLP's
  own message definitions. It also counts resources, scopes and metrics (``max_resources``, ``max_metrics``:
  the translation walks each) and the nesting depth (``MAX_DEPTH``). A scope's metrics, or failing that a
  metric's points, are bounded without a walk where that is enough: every message and entry in them starts
  with a length tag, so the count of bytes that could be one bounds them at C speed; only a request that
  these bounds put over the budget is walked closer, then exactly (its points counted too). Where the walk
  does not count scopes' metrics, the translation does, exactly, and stops at the cap. ``json_census``
  bounds an OTLP/JSON body before ``json.loads``: its objects, arrays and commas (one Python object each at
  most) and its text, at the width Python will store it in.
- What the translation makes (``max_made_bytes``): ``otlp.translate`` adds up ``POINT_MADE`` a point,
  ``LABEL_MADE`` a label of a new label set and ``VALUE_MADE`` a bucket, bound or quantile value as it goes,
  with the points themselves (``max_points``), and stops at either bound.

Over a bound the request is refused whole (``TooMuch``: the message names the bound and the flag), before
more is made; the receiver answers 413 (gRPC ``INVALID_ARGUMENT``: the Python SDK retries
``RESOURCE_EXHAUSTED``). A body that is not valid protobuf (a length past its end, a group, a bad wire type)
stops the walk with what was counted so far: the parse that follows refuses it with its own message, having
built no more than that. Bodies up to ``SMALL_BODY`` bytes are not walked: they cannot make more than
``SMALL_BODY / 2`` messages, and one rank's export (a few KiB) pays nothing.

Pure: bytes in, counts or ``TooMuch`` out; never parses, never performs I/O and holds no state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

#: Bodies this small are not walked (see the module docstring): 64 KiB make at most 32,768 messages.
SMALL_BODY = 64 * 1024
#: Default of ``--otlp.max-points-per-request``: a Collector's batch (8,192 points by default) fits twice.
DEFAULT_MAX_POINTS = 16_384
#: What the parse allocates (protobuf's upb parser, measured): 31 to 80 bytes a message however few bytes it
#: took on the wire (``_message_bytes``: by its number of fields, its slot in a list included; at most
#: ``MESSAGE_BYTES``), 24 a repeated string or bytes entry (a data point's attribute), 8 a varint of a packed
#: list (fixed-size numbers take what they took on the wire: the walk adds a region's own size).
MESSAGE_BYTES = 96
ENTRY_BYTES = 24
VARINT_BYTES = 8
#: What the translation makes: a point (its ``Point``, a list slot, its parser object while it is read), a
#: label of a label set not seen before (the strings and the pair), a bucket count, bound or half a quantile.
POINT_MADE = 256
LABEL_MADE = 160
VALUE_MADE = 40
#: The two budgets per data point the request may carry, with floors: 24 MiB each at the default. A
#: helper's point takes about 310 bytes of the first and 750 of the second (3 new labels).
DECODED_BYTES_PER_POINT = 1536
MIN_DECODED_BYTES = 24 << 20
MADE_BYTES_PER_POINT = 1536
MIN_MADE_BYTES = 24 << 20
MIN_RESOURCES = 256
#: Deepest nesting of messages (OTLP's own is 5 to a data point; attribute values nest arrays and maps).
MAX_DEPTH = 32
#: A data-point attribute (``KeyValue``) of at most this many bytes is counted as one entry without being
#: walked: what it makes when the receiver parses it (at most ``n / 2`` messages) is transient and small.
_ATTRIBUTE_WALK_FROM = 128
_SMALLER = "send smaller batches (an OpenTelemetry Collector's batch processor: send_batch_max_size)"


class TooMuch(ValueError):
    """The request would make more than a limit allows; the message names it and its flag."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may make (``--otlp.max-points-per-request``, the rest derived from it at construction:
    the translation reads them per metric).

    ``max_decoded_bytes``: what the parse may allocate (``census``'s estimate). ``max_made_bytes``: what the
    translation may make (``Batch.made``). ``max_metrics``: every metric worth sending carries a point.
    ``max_resources``: resources, and scopes (a trainer's process is one resource with one scope and a dozen
    points). ``max_json_items``: objects, arrays and commas in an OTLP/JSON body; loaded, each makes 100 bytes
    at most (a one-key object and the comma after it make 192; a helper's point has about 20 items)."""

    max_points: int = DEFAULT_MAX_POINTS
    max_decoded_bytes: int = field(init=False)
    max_made_bytes: int = field(init=False)
    max_metrics: int = field(init=False)
    max_resources: int = field(init=False)
    max_json_items: int = field(init=False)

    def __post_init__(self) -> None:
        if self.max_points <= 0:
            raise ValueError("max_points must be positive")
        decoded = max(MIN_DECODED_BYTES, DECODED_BYTES_PER_POINT * self.max_points)
        for name, value in (("max_decoded_bytes", decoded),
                            ("max_made_bytes", max(MIN_MADE_BYTES, MADE_BYTES_PER_POINT * self.max_points)),
                            ("max_metrics", self.max_points),
                            ("max_resources", max(MIN_RESOURCES, self.max_points // 4)),
                            ("max_json_items", decoded // 128)):
            object.__setattr__(self, name, value)

    def refusal(self, points: int, made: int) -> str:
        """Why the translation stopped (``points`` so far, ``made`` bytes so far)."""
        if points > self.max_points:
            return points_refusal(self.max_points)
        return (f"the request's points, labels and buckets would take more than {self.max_made_bytes >> 20} MiB "
                f"once translated ({MADE_BYTES_PER_POINT} bytes a data point that --otlp.max-points-per-request "
                f"allows); {_SMALLER}")


def kind_refusal(what: str, cap: int) -> str:
    """Why a request of more than ``cap`` resources, scopes or metrics is refused."""
    return f"the request holds more than {cap} {what} (derived from --otlp.max-points-per-request); {_SMALLER}"


def points_refusal(max_points: int) -> str:
    """Why a request of more than ``max_points`` data points is refused (here or at its translation)."""
    return f"the request holds more than {max_points} data points (--otlp.max-points-per-request); {_SMALLER}"


DEFAULT_REQUEST_LIMITS = RequestLimits()


@dataclass(slots=True)
class Counts:
    """What a request makes: ``decoded_bytes`` estimates the parse's memory (every message and repeated entry at
    any depth), the others count by kind."""

    resources: int = 0
    scopes: int = 0
    metrics: int = 0
    points: int = 0
    decoded_bytes: int = 0
    walked: bool = False  # False: the body was small enough not to be walked (the counts are zero)


# ----------------------------------------------------------------------------------------------------
# the walk's tables, built from OTLP's descriptors at import

_BYTES, _RESOURCE, _SCOPE, _METRIC, _POINT, _DATA = range(6)
_KIND = {
    "opentelemetry.proto.metrics.v1.ResourceMetrics": _RESOURCE,
    "opentelemetry.proto.metrics.v1.ScopeMetrics": _SCOPE,
    "opentelemetry.proto.metrics.v1.Metric": _METRIC,
    "opentelemetry.proto.metrics.v1.NumberDataPoint": _POINT,
    "opentelemetry.proto.metrics.v1.HistogramDataPoint": _POINT,
    "opentelemetry.proto.metrics.v1.ExponentialHistogramDataPoint": _POINT,
    "opentelemetry.proto.metrics.v1.SummaryDataPoint": _POINT,
}
#: Actions on a length-delimited field: walk a message (with its table), count one entry, count packed
#: varints. A field not in a table (strings, packed fixed-size numbers, unknown fields) is skipped.
_PACKED_VARINT = "packed varint"
_PACKED_FIXED = "packed fixed"
_ENTRY = "entry"
_ATTRIBUTES = "attributes"
_FIXED64_TYPES = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
_VARINT_TYPES = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
                 FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
                 FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM}

#: A metric's data whose points hold no packed varints: bounded without a walk where the bound is enough
#: (``_Walk``). An exponential histogram's buckets are packed varints: always walked.
_BOUNDED_DATA = frozenset({"gauge", "sum", "histogram", "summary"})
#: Bytes that can be the tag of a length-delimited field numbered 1 to 15 (every OTLP metrics field): each
#: message or entry in a region starts with one, so what is left once the others are deleted bounds them.
_NOT_LENGTH_TAGS = bytes(b for b in range(256) if not (b < 0x80 and b & 7 == 2 and b >> 3))

_Table = dict[int, tuple[object, int, int]]  # tag -> (action: a table or a name above; kind; bytes it makes)


def _message_bytes(desc: Descriptor) -> int:
    """What the parse allocates for one ``desc`` message: 16 bytes and 8 a field (32 to 80), and 16 for its
    slot in a list (a pointer, in an array grown by doubling)."""
    return min(MESSAGE_BYTES - 16, max(32, 16 + 8 * len(desc.fields))) + 16


def _table(desc: Descriptor, tables: dict[str, _Table]) -> _Table:
    table = tables.get(desc.full_name)
    if table is not None:
        return table
    table = tables[desc.full_name] = {}
    for fd in desc.fields:
        repeated = bool(fd.is_repeated) if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        len_tag = fd.number << 3 | 2
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            child = _table(fd.message_type, tables)
            weight = _message_bytes(fd.message_type)
            if fd.name == "attributes" and desc.full_name in _KIND and _KIND[desc.full_name] == _POINT:
                table[len_tag] = (_ATTRIBUTES, _BYTES, ENTRY_BYTES)  # bytes in ``wire.WireRequest``
            elif desc.full_name == "opentelemetry.proto.metrics.v1.Metric" and fd.name in _BOUNDED_DATA:
                table[len_tag] = (child, _DATA, weight)
            else:
                table[len_tag] = (child, _KIND.get(fd.message_type.full_name, _BYTES), weight)
        elif repeated and fd.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            table[len_tag] = (_ENTRY, _BYTES, ENTRY_BYTES)
        elif repeated and fd.type in _VARINT_TYPES:
            table[len_tag] = (_PACKED_VARINT, _BYTES, VARINT_BYTES)
            table[fd.number << 3] = (_ENTRY, _BYTES, VARINT_BYTES)  # unpacked: 8 bytes from 2 on the wire
        elif repeated:  # fixed-size numbers: packed, what the list took; unpacked, 8 bytes each
            table[len_tag] = (_PACKED_FIXED, _BYTES, 1)
            table[fd.number << 3 | (1 if fd.type in _FIXED64_TYPES else 5)] = (_ENTRY, _BYTES, VARINT_BYTES)
    return table


_TABLES: dict[str, _Table] = {}
_ROOT = _table(ExportMetricsServiceRequest.DESCRIPTOR, _TABLES)
_KEY_VALUE = _TABLES["opentelemetry.proto.common.v1.KeyValue"]
#: Bytes whose high bit is set: what is left of a packed varint region once they are deleted is one byte
#: per varint.
_CONTINUATION = bytes(range(0x80, 0x100))


class _Stop(Exception):
    """The body is not valid protobuf here: the parse will say so."""


class _Walk:
    """One walk of ``data``: ``counts`` by kind (``_BYTES``: the decoded estimate), refusing past ``caps``."""

    __slots__ = ("data", "counts", "caps", "bound")

    def __init__(self, data: bytes, limits: RequestLimits, bound: int) -> None:
        self.data = data
        self.bound = bound  # COARSE, METRICS or EXACT (``census``)
        self.counts = [0, 0, 0, 0, 0]
        self.caps = (limits.max_decoded_bytes, limits.max_resources, limits.max_resources, limits.max_metrics,
                     limits.max_points)

    def message(self, pos: int, end: int, table: _Table) -> None:
        """Count what the message in ``data[pos:end]`` makes (the message itself is its caller's count). One loop
        with a stack of the messages it is in: a call per message would cost more than the rest of the walk."""
        data = self.data
        counts = self.counts
        caps = self.caps
        cap = caps[_BYTES]
        stack: list[tuple[int, _Table]] = []
        while True:
            if pos >= end:
                if pos != end:
                    raise _Stop
                if not stack:
                    return
                end, table = stack.pop()
                continue
            tag = data[pos]
            pos += 1
            if tag & 0x80:
                tag, pos = _varint(data, pos, tag)
            wire = tag & 7
            if wire == 2:
                n = data[pos]
                pos += 1
                if n & 0x80:
                    n, pos = _varint(data, pos, n)
                stop = pos + n
                if stop > end:
                    raise _Stop
                action = table.get(tag)
                if action is None:
                    pos = stop
                    continue
                child, kind, weight = action
                if child is _ENTRY:
                    counts[_BYTES] += weight
                elif child is _ATTRIBUTES:
                    counts[_BYTES] += weight
                    if n > _ATTRIBUTE_WALK_FROM:  # parsed later, a point's at a time: a long one is walked
                        child = _KEY_VALUE
                elif child is _PACKED_VARINT:
                    counts[_BYTES] += VARINT_BYTES * len(data[pos:stop].translate(None, _CONTINUATION))
                elif child is _PACKED_FIXED:
                    counts[_BYTES] += n
                elif kind == _DATA:
                    counts[_BYTES] += weight
                    if self.bound:  # METRICS (COARSE never gets here)
                        # Every point and everything in it starts with a length tag: their count bounds what the
                        # parse makes (the points are counted by the translation, which stops at the cap). Over
                        # the cap, TooMuch has the request walked again, exactly (``census``).
                        counts[_BYTES] += MESSAGE_BYTES * len(data[pos:stop].translate(None, _NOT_LENGTH_TAGS)) + n
                        child = _ENTRY
                else:
                    counts[_BYTES] += weight
                    if kind:
                        counts[kind] += 1
                        if counts[kind] > caps[kind]:
                            raise TooMuch(self._kind_message(kind))
                        if kind == _SCOPE and self.bound == COARSE:
                            # The whole scope bounded as a metric's points are (above), and 8 bytes a byte for
                            # the packed varints an exponential histogram may hold; its metrics are counted by
                            # the translation (exactly: it stops at the cap).
                            counts[_BYTES] += (MESSAGE_BYTES * len(data[pos:stop].translate(None, _NOT_LENGTH_TAGS))
                                               + VARINT_BYTES * n)
                            child = _ENTRY
                if counts[_BYTES] > cap:
                    raise TooMuch(self._bytes_message())
                if type(child) is dict:  # a message: walk it, then go on after it
                    if len(stack) >= MAX_DEPTH:
                        raise TooMuch(f"the request nests messages more than {MAX_DEPTH} deep; OTLP needs a "
                                      "handful")
                    stack.append((end, table))
                    end, table = stop, child
                    continue
                pos = stop
            else:
                if wire == 1:
                    pos += 8
                elif wire == 0:
                    while data[pos] & 0x80:
                        pos += 1
                    pos += 1
                elif wire == 5:
                    pos += 4
                else:
                    raise _Stop  # groups (never in OTLP) or no wire type at all
                if tag in table:  # an unpacked repeated number
                    counts[_BYTES] += table[tag][2]
                    if counts[_BYTES] > cap:
                        raise TooMuch(self._bytes_message())

    def _kind_message(self, kind: int) -> str:
        if kind == _POINT:
            return points_refusal(self.caps[_POINT])
        return kind_refusal(("", "resources", "scopes", "metrics")[kind], self.caps[kind])

    def _bytes_message(self) -> str:
        return (f"the request would take more than {self.caps[_BYTES] >> 20} MiB to decode ({MESSAGE_BYTES} bytes a "
                f"message, {ENTRY_BYTES} an attribute, however small on the wire; {DECODED_BYTES_PER_POINT} bytes a "
                f"data point that --otlp.max-points-per-request allows); {_SMALLER}")


def _varint(data: bytes, pos: int, first: int) -> tuple[int, int]:
    """The varint whose first byte ``first`` was read (high bit set); (value, position after it)."""
    value = first & 0x7F
    shift = 7
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _Stop


#: How closely ``census`` walks: scopes bounded as a whole, metrics' points bounded, everything walked.
COARSE, METRICS, EXACT = 2, 1, 0


def _walk(data: bytes, limits: RequestLimits, *, bound: int) -> _Walk:
    walk = _Walk(data, limits, bound)
    try:
        walk.message(0, len(data), _ROOT)
    except (_Stop, IndexError):
        pass  # not valid protobuf: the parse refuses it, having made no more than was counted
    return walk


def census(data: bytes, limits: RequestLimits = DEFAULT_REQUEST_LIMITS) -> Counts:
    """Count what parsing ``data`` (a protobuf ``ExportMetricsServiceRequest``) would make; ``TooMuch`` as soon
    as a limit is passed. A body of at most ``SMALL_BODY`` bytes is not walked (``Counts.walked`` False)."""
    if len(data) <= SMALL_BODY:
        return Counts()
    try:
        walk = _walk(data, limits, bound=COARSE)
    except TooMuch:
        try:  # the bounds were too loose: closer (or refuse)
            walk = _walk(data, limits, bound=METRICS)
        except TooMuch:
            walk = _walk(data, limits, bound=EXACT)
    c = walk.counts
    return Counts(c[_RESOURCE], c[_SCOPE], c[_METRIC], c[_POINT], c[_BYTES], walked=True)


#: In a JSON body: what makes Python store its text (and the strings in it) 4 bytes a character (a character
#: beyond the BMP, as UTF-8 or as an escaped surrogate), or 2 (any other character beyond Latin-1, or any escape).
_WIDE4 = re.compile(rb"[\xf0-\xf4]|\\u[dD][89abAB]")
_WIDE2 = re.compile(rb"[\xc4-\xef]|\\u")


def json_census(body: bytes, limits: RequestLimits = DEFAULT_REQUEST_LIMITS) -> int:
    """What loading an OTLP/JSON body would make: its objects, arrays and commas (one Python object each, 100
    bytes at most: braces and commas inside strings are counted too, an upper bound) and its text twice (the
    decoded document, and the strings in it) at the width Python stores it in. ``TooMuch`` over
    ``limits.max_json_items`` items, or over both budgets together; returns the estimate in bytes."""
    if len(body) <= SMALL_BODY:
        return 0
    items = body.count(b"{") + body.count(b"[") + body.count(b",")
    if items > limits.max_json_items:
        raise TooMuch(f"the JSON body holds {items} objects, arrays and values, more than "
                      f"{limits.max_json_items} (derived from --otlp.max-points-per-request); {_SMALLER}, or "
                      "send protobuf")
    width = 4 if _WIDE4.search(body) else 2 if _WIDE2.search(body) else 1
    estimate = 100 * items + 2 * width * len(body)
    budget = limits.max_decoded_bytes + limits.max_made_bytes
    if estimate > budget:
        raise TooMuch(f"the JSON body would take about {estimate >> 20} MiB to load ({len(body)} bytes of text "
                      f"that Python stores {width} bytes a character, {items} objects and values), more than "
                      f"{budget >> 20} MiB (derived from --otlp.max-points-per-request); {_SMALLER}, or send "
                      "protobuf")
    return estimate
