"""The scrape-side view: what /metrics serves, built only from in-memory state.

``SnapshotCollector.collect`` yields the families the sampler already built, plus a few values that must
be computed at scrape time (sample ages) and the live in-memory sources (training series pushed over
OTLP, per-run series of the ledger). It never calls NVML, never reads sysfs and never blocks on the
sampler: a slow or hung driver cannot make a scrape slow.

``CachedExposition`` is the fast path used by the HTTP handler: each source (the snapshot, the training
store, ...) is encoded once per version and per format, so a scrape between two changes is cached bytes
plus the few values computed at scrape time (the sample ages), handed to the server as parts that it writes
one after another without joining them. ``PreparedSource`` is for a
source that changes between most scrapes and is costly to collect (the run ledger): it is encoded on the
sampler thread after a snapshot when a scrape is expected soon, and the scrape serves the bytes ready.
``name[]`` filtering cuts the same bytes (``select_samples``): there is one exposition path, and the golden
file is rendered through it. ``SnapshotCollector`` yields the same families for prometheus_client's registry
(tests, tools).
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector
from prometheus_client.registry import CollectorRegistry

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core import encoder
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.core.metrics import add, define
from gpu_energy_exporter.core.state import GPU_SAMPLE_AGE
from gpu_energy_exporter.engine.sampler import Sampler

log = logging.getLogger(__name__)

BUILD_INFO = define(
    "build", "info", "info", "Exporter version and Python runtime.", ["version", "python_version"],
    collector="exporter",
)


def build_info_family() -> Metric:
    fam = BUILD_INFO.family()
    add(fam, [], {"version": __version__, "python_version": platform.python_version()})
    return fam

LiveSource = Callable[[], Iterable[Metric]]


class SnapshotCollector(PromCollector):
    def __init__(self, sampler: Sampler, live_sources: Iterable[LiveSource] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self._sampler = sampler
        self._live = list(live_sources)
        self._clock = clock
        self._build_info = build_info_family()
        self._age_heads: dict[tuple[int, str, bool], bytes] = {}
        self._age_headers: dict[bool, bytes] = {}

    def add_live_source(self, source: LiveSource) -> None:
        self._live.append(source)

    def describe(self) -> Iterable[Metric]:
        # Registration must not touch hardware or the snapshot; names are checked by the catalogue tests.
        return []

    def snapshot_families(self) -> tuple[Metric, ...]:
        snap = self._sampler.snapshot
        return snap.families if snap is not None else ()

    def snapshot_version(self) -> object:
        snap = self._sampler.snapshot
        return snap.seq if snap is not None else None

    def age_families(self) -> list[Metric]:
        """Seconds since each GPU's last good sample: the one value that must be computed per scrape."""
        snap = self._sampler.snapshot
        if snap is None or not snap.gpus:
            return []
        age = GPU_SAMPLE_AGE.family()
        now = self._clock()
        for g in snap.gpus:
            if g.last_good is not None:
                add(age, [str(g.identity.index), g.identity.uuid], max(0.0, now - g.last_good))
        return [age]

    def age_render(self, openmetrics: bool) -> bytes:
        """``encode(self.age_families(), openmetrics)``, the same bytes, written from cached sample heads."""
        snap = self._sampler.snapshot
        if snap is None or not snap.gpus:
            return b""
        now = self._clock()
        out = [self._age_header(openmetrics)]
        heads = self._age_heads
        for g in snap.gpus:
            if g.last_good is not None:
                key = (g.identity.index, g.identity.uuid, openmetrics)
                head = heads.get(key)
                if head is None:
                    head = remember(heads, key, encoder.sample_head(
                        GPU_SAMPLE_AGE.name, (("gpu", str(g.identity.index)), ("gpu_uuid", g.identity.uuid)),
                        openmetrics), 1024)
                out += (head, encoder.go_float(max(0.0, now - g.last_good)).encode("ascii"), b"\n")
        return b"".join(out)

    def _age_header(self, openmetrics: bool) -> bytes:
        header = self._age_headers.get(openmetrics)
        if header is None:
            header = self._age_headers[openmetrics] = encoder.header(GPU_SAMPLE_AGE.family(), openmetrics)
        return header

    def static_families(self) -> list[Metric]:
        return [self._build_info]

    def live_families(self) -> Iterator[Metric]:
        for source in self._live:
            try:
                yield from source()
            except Exception:  # noqa: BLE001 - a broken live source must not fail the scrape
                log.exception("live metrics source %r failed", source)

    def collect(self) -> Iterator[Metric]:
        yield from self.static_families()
        yield from self.snapshot_families()
        yield from self.age_families()
        yield from self.live_families()


def new_registry(collector: SnapshotCollector) -> CollectorRegistry:
    """A registry with only our collector (no global state, no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


_OM_EOF = b"# EOF\n"


def encode(families: Iterable[Metric], openmetrics_format: bool) -> bytes:
    """Families to exposition bytes; OpenMetrics without its ``# EOF`` (added once per response).

    ``encoder.encode_families``: prometheus_client's bytes, written directly where it can (several times
    faster: every cache miss of the ledger's per-run series and of the GPU snapshot goes through here)."""
    return encoder.encode_families(families, openmetrics_format)


@dataclass
class CachedSource:
    """A source of families with a version: encoded again only when the version changes."""

    collect: Callable[[], Iterable[Metric]]
    version: Callable[[], object] | None = None  # None: encoded on every scrape (small, dynamic)
    #: the source's own encoder (OpenMetrics without ``# EOF``), e.g. one that re-encodes only what changed
    encoder: Callable[[bool], bytes] | None = None
    _cache: dict[bool, tuple[object, bytes]] = field(default_factory=dict)

    def _encode(self, openmetrics_format: bool) -> bytes:
        if self.encoder is not None:
            return self.encoder(openmetrics_format)
        return encode(self.collect(), openmetrics_format)

    def render(self, openmetrics_format: bool) -> bytes:
        if self.version is None:
            return self._encode(openmetrics_format)
        version = self.version()
        hit = self._cache.get(openmetrics_format)
        if hit is not None and hit[0] == version:
            return hit[1]
        body = self._encode(openmetrics_format)
        # Racing scrapes may both encode; either result is correct for this version.
        self._cache[openmetrics_format] = (version, body)
        return body


class PreparedSource:
    """A source encoded off the scrape path, ahead of the scrapes that will serve it.

    ``prepare()`` runs on the sampler thread after each snapshot (a sampler listener). A format a scrape asked
    for in the last ``wanted_for`` seconds is encoded there when its next scrape is expected before the
    sample after next: scrapers come at a period (Prometheus' ``scrape_interval``), so the time since a
    format's last scrape and the gap between its last two scrapes say when the next one comes. A source that
    did not change since its bytes were encoded is not encoded again. ``render(openmetrics)`` (the scrape)
    serves the bytes when they are as of the latest snapshot; otherwise (a format's first scrape, a scrape
    before its period is known or off its rhythm, a scrape before the first snapshot) it encodes them
    itself, as of now. So the bytes served are what ``collect()`` returned at the latest snapshot or later:
    they lag a change made between two snapshots (a push) by at most one sampling interval. Used for the run
    ledger, whose figures change with every push and every snapshot and cost milliseconds to collect:
    encoded at every sample (before issue 28's cost target) they were 0.035% of a core for a scrape every
    15 s or more, at 8 GPUs and no run; now at the samples within two intervals of each expected scrape
    (three per period at 1 s: a scrape up to a sample early still finds them).

    One lock orders the encodes (a prepare and a scrape's own encode never store older bytes over newer
    ones: the ledger's counters must never go down); a scrape that finds bytes ready never takes it."""

    #: A format is prepared when its next scrape is expected within this many sampling intervals.
    LEAD_SAMPLES = 2.0

    def __init__(self, collect: Callable[[], Iterable[Metric]], version: Callable[[], object], *,
                 clock: Callable[[], float] = time.monotonic, wanted_for: float = 600.0) -> None:
        self.collect = collect
        self._version = version
        self._clock = clock
        self._wanted_for = wanted_for
        self._asked: dict[bool, float] = {}  # format -> when a scrape last asked for it
        self._gap: dict[bool, float] = {}  # format -> the time between its last two scrapes
        self._ready: dict[bool, tuple[bytes, int, object]] = {}  # format -> (bytes, snapshot no., version)
        self._snapshots = 0  # prepare() calls so far: the latest snapshot's number
        self._last_prepare: float | None = None
        self._lock = threading.Lock()

    def render(self, openmetrics_format: bool) -> bytes:
        now = self._clock()
        last = self._asked.get(openmetrics_format)
        if last is not None:
            self._gap[openmetrics_format] = now - last
        self._asked[openmetrics_format] = now
        ready = self._ready.get(openmetrics_format)
        if ready is not None and ready[1] == self._snapshots:
            return ready[0]
        with self._lock:
            ready = self._ready.get(openmetrics_format)
            if ready is not None and ready[1] == self._snapshots:
                return ready[0]
            version = self._version()
            if ready is not None and ready[2] == version:
                body = ready[0]  # nothing changed since they were encoded
            else:
                body = encode(self.collect(), openmetrics_format)
            self._ready[openmetrics_format] = (body, self._snapshots, version)
            return body

    def prepare(self, _snapshot: object = None) -> None:
        """Encode the formats whose next scrape is expected soon, if the source changed (a sampler
        listener)."""
        now = self._clock()
        step = now - self._last_prepare if self._last_prepare is not None else 0.0
        self._last_prepare = now
        wanted = [om for om, t in list(self._asked.items()) if now - t <= self._wanted_for]
        with self._lock:
            self._snapshots += 1
            for om in (False, True):
                if om not in wanted:
                    self._ready.pop(om, None)
            if not wanted:
                return
            version = self._version()
            families: list[Metric] | None = None
            for om in wanted:
                ready = self._ready.get(om)
                if ready is not None and ready[2] == version:
                    self._ready[om] = (ready[0], self._snapshots, version)  # still current
                    continue
                gap = self._gap.get(om)
                if gap is None or now + self.LEAD_SAMPLES * step < self._asked[om] + gap:
                    continue  # no scrape expected before the sample after next: a scrape encodes if one comes
                if families is None:
                    families = list(self.collect())
                self._ready[om] = (encode(families, om), self._snapshots, version)


class CachedExposition:
    """Render /metrics from cached per-source encodings. Sources must not share metric names."""

    def __init__(self, sources: Iterable[CachedSource]) -> None:
        self.sources = list(sources)

    def render(self, accept: str, names: frozenset[str] | None = None) -> tuple[bytes | tuple[bytes, ...], str]:
        """The body served for ``accept``; with ``names`` (``?name[]=``), only those samples.

        This is the one exposition path: unfiltered and filtered scrapes are cut from the same cached
        bytes, so a filter sees exactly the series an unfiltered scrape serves. Unfiltered, the body is
        each source's bytes in order (a tuple), written one after another without joining them (a
        response of a few hundred KiB costs a fresh buffer, page faults included, at every join)."""
        content_type = _content_type(accept)
        om = content_type.startswith("application/openmetrics-text")
        parts = []
        for source in self.sources:
            try:
                parts.append(source.render(om))
            except Exception:  # noqa: BLE001 - a broken source must not fail the scrape
                log.exception("metrics source %r failed", source.collect)
        if om:
            parts.append(_OM_EOF)
        if names is None:
            return tuple(parts), content_type
        body = select_samples(b"".join(parts), names)
        return body, content_type


_CONTENT_TYPES: dict[str, str] = {}


def _content_type(accept: str) -> str:
    """``prometheus_client``'s choice of format for an ``Accept`` header, remembered (a scraper sends the same
    header every time)."""
    content_type = _CONTENT_TYPES.get(accept)
    if content_type is None:
        content_type = remember(_CONTENT_TYPES, accept, encoder.content_type(accept), 64)
    return content_type


def select_samples(body: bytes, names: frozenset[str]) -> bytes:
    """The exposition ``body`` (text 0.0.4 or OpenMetrics) cut down to the samples named in ``names``.

    Sample names, as prometheus_client's ``name[]`` filter has them (``x_total``, ``x_bucket``, ...);
    each kept sample keeps its family's ``# HELP``/``# TYPE``/``# UNIT`` lines, and a family with no
    kept sample disappears. ``# EOF`` is kept.
    """
    wanted = {n.encode("utf-8") for n in names}
    out: list[bytes] = []
    header: list[bytes] = []
    family = b""
    header_out = False
    for line in body.splitlines(keepends=True):
        if line.startswith(b"#"):
            parts = line.split(b" ", 3)
            if len(parts) >= 3 and parts[1] in (b"HELP", b"TYPE", b"UNIT"):
                if parts[2] != family:
                    family, header, header_out = parts[2], [], False
                header.append(line)
            elif line.rstrip() == b"# EOF":
                out.append(line)
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if name in wanted:
            if not header_out:
                out.extend(header)
                header_out = True
            out.append(line)
    return b"".join(out)
