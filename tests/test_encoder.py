"""The direct exposition encoder writes exactly what prometheus_client writes (issue 15).

The training store encodes each series when a push changes it and a scrape joins ready bytes; these tests
compare that output, byte for byte, with prometheus_client's ``generate_latest`` (text 0.0.4) and its
OpenMetrics encoder applied to the same store content (``TrainingStore.collect()``), after every push,
for counters, gauges (NaN, +-Inf), histograms (with and without a sum, layout changes), summaries, odd
label values, names with ``:`` and ``target_info``; and the value formatting against ``floatToGoString``.
"""

from __future__ import annotations

import math
import random
import struct

from helpers import registry_of
from prometheus_client import exposition as text_exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gpu_energy_exporter.core import encoder
from gpu_energy_exporter.otlp.points import Batch, Labels, Point, series_bytes
from gpu_energy_exporter.otlp.store import TrainingStore

ODD_VALUES = ['quote " inside', "back\\slash", "new\nline", "tab\tand ünïcødé ✓ 日本", "ends with \\", '\\"\n',
              "{braces}=,comma"]


def reference(families: list[Metric], openmetrics: bool) -> bytes:
    if openmetrics:
        return om_exposition.generate_latest(registry_of(families)).removesuffix(b"# EOF\n")
    return text_exposition.generate_latest(registry_of(families))


def _point(kind: str, name: str, labels: dict[str, str], t: int, **kw: object) -> Point:
    key: Labels = tuple(sorted(labels.items()))
    p = Point(kind, name, f"help of {name} with a \\ and\nnewline", "", key,  # type: ignore[arg-type]
              labels.get("run_id", ""), 1, t, **kw)  # type: ignore[arg-type]
    p.cost = series_bytes(name, key, kind, buckets=len(p.counts), quantiles=len(p.quantiles))
    return p


def _check(store: TrainingStore) -> None:
    families = store.collect()
    for om in (False, True):
        assert store.render(om) == reference(families, om), f"openmetrics={om}"


def test_store_render_is_byte_identical_to_prometheus_client() -> None:
    store = TrainingStore()
    t = 10**18
    for step in range(4):
        t += 10**9
        points: list[Point] = []
        for i, odd in enumerate(ODD_VALUES):
            labels = {"run_id": f"r{i % 2}", "rank": str(i), "note": odd}
            points.append(_point("counter", "train_tokens_total", labels, t, value=1.5e6 * step + i))
            points.append(_point("gauge", "train_loss", labels, t,
                                 value=[math.nan, math.inf, -math.inf, 0.1 * i, 1e21, -2.5e-7][(i + step) % 6]))
            bounds = (0.005, 0.5, 1.0, 12345678.0) if step < 2 else (0.1, 1e7)  # a layout change at step 2
            counts = tuple(range(len(bounds) + 1))
            points.append(_point("histogram", "train_step_seconds", labels, t, bounds=bounds, counts=counts,
                                 count=sum(counts), sum=None if i == 3 else 2.5 * step))
            points.append(_point("summary", "train_latency", labels, t, quantiles=((0.5, 0.1 * step), (0.99, math.nan)),
                                 count=step, sum=1.0 * step))
        points.append(_point("gauge", "ns:colon_metric", {"run_id": "r0", "x": "y"}, t, value=step))
        points.append(_point("unknown", "untyped_thing", {}, t, value=-0.0))
        batch = Batch(points=points, received=len(points),
                      resources=[(("service_name", 'svc "q"\n'), ("host_name", "h\\1"))])
        result = store.apply(batch)
        assert result.accepted == len(points), result.messages
        _check(store)
        _check(store)  # the second render serves the families' cached blocks
    # a series going away and a family emptied
    end = _point("gauge", "ns:colon_metric", {"run_id": "r0", "x": "y"}, t + 10**9, no_value=True)
    store.apply(Batch(points=[end], received=1))
    _check(store)
    text = store.render(False)
    assert b'note="quote \\" inside"' in text and b'note="new\\nline"' in text and b"train_loss" in text
    assert b"ns:colon_metric" not in text


def test_go_float_matches_float_to_go_string() -> None:
    rng = random.Random(15)
    values = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e6, 999999.0, 1000000.5, 1234567.0,
              12345678.9, 1e15, 1e16, 1e22, 5e-324, 1.7976931348623157e308, -1234567.0, 0.1, 123456.789]
    values += [rng.uniform(-1e9, 1e9) for _ in range(2000)]
    values += [struct.unpack("d", rng.randbytes(8))[0] for _ in range(2000)]
    values += [float(rng.randrange(10**12)) for _ in range(500)]
    for v in values:
        assert encoder.go_float(v) == floatToGoString(v), repr(v)


def test_encode_families_matches_prometheus_client_and_falls_back() -> None:
    c = CounterMetricFamily("reqs", "Requests \\ \n.", labels=["code"])
    c.add_metric(["200"], 3)
    c.add_metric(['4"0\n0'], 1.5)
    g = GaugeMetricFamily("temp_celsius", "Temperature.", labels=["gpu"], unit="celsius")
    g.add_metric(["0"], math.nan)
    g.add_metric(["1"], 1e300)
    created = CounterMetricFamily("made", "With _created.", labels=["a"], created=1700000000.5)
    created.add_metric(["x"], 2, created=1700000000.25)
    stamped = GaugeMetricFamily("stamped", "Timestamped.")
    stamped.add_metric([], 1.0, timestamp=1700000000.125)
    info = Metric("target", "Info.", "info")
    info.samples.append(Sample("target_info", {"k": "v\\"}, 1.0))
    families: list[Metric] = [c, g, created, stamped, info]
    for om in (False, True):
        assert encoder.encode_families(families, om) == reference(families, om)


def test_a_scrape_after_a_full_repush_does_not_reencode_through_prometheus_client(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 15: a scrape after every series changed cost 33x serving the same bytes, because the store
    ran prometheus_client's encoder once per changed series at scrape time. Now a push encodes its series
    and a scrape only joins bytes: after the families exist, no prometheus_client encoder call at all."""
    store = TrainingStore()

    def push(t: int) -> None:
        points = [_point("gauge", "train_loss", {"run_id": "r0", "rank": str(i)}, t, value=0.5 * t)
                  for i in range(300)]
        points += [_point("histogram", "train_step_seconds", {"run_id": "r0", "rank": str(i)}, t,
                          bounds=(0.1, 1.0), counts=(1, 2, 3), count=6, sum=2.0) for i in range(300)]
        assert store.apply(Batch(points=points, received=len(points))).accepted == len(points)

    push(10**9)
    store.render(False)
    store.render(True)  # family headers are encoded once per format
    calls = []
    for module in (text_exposition, om_exposition):
        real = module.generate_latest

        def counting(*a: object, _real=real, **kw: object) -> bytes:  # type: ignore[no-untyped-def]
            calls.append(1)
            return _real(*a, **kw)
        monkeypatch.setattr(module, "generate_latest", counting)
    push(2 * 10**9)
    text, om = store.render(False), store.render(True)
    assert len(calls) == 0, f"{len(calls)} prometheus_client encoder calls for one scrape after a re-push"
    monkeypatch.undo()
    families = store.collect()
    assert text == reference(families, False) and om == reference(families, True)


HEADER_DOCS = ["plain help", 'with "quotes"', "back\\slash and\nnewline", "ünïcødé ✓", ""]


def test_family_headers_match_prometheus_client_for_every_type_and_odd_help() -> None:
    # encoder.header writes HELP/TYPE(/UNIT) itself for plain names, so a scrape never imports
    # prometheus_client.exposition (http.server, urllib, ssl): the bytes must stay prometheus_client's.
    encoder._HEADER_CACHE.clear()
    for mtype in ("counter", "gauge", "summary", "histogram", "gaugehistogram", "info", "stateset", "unknown"):
        for doc in HEADER_DOCS:
            for unit in ("", "seconds"):
                name = "gpuenergy_x_seconds" if unit else "gpuenergy_x"
                family = Metric(name, doc, mtype, unit)
                for openmetrics in (False, True):
                    assert encoder._direct_header(family, openmetrics) == reference([family], openmetrics), \
                        (mtype, doc, unit, openmetrics)
    # names the direct path leaves to prometheus_client: still its bytes, through the fallback
    for name in ("ns:recording_rule", "gpuenergy_x"):
        family = Metric(name, "h", "gauge")
        for openmetrics in (False, True):
            assert encoder.header(family, openmetrics) == reference([family], openmetrics)


ACCEPT_HEADERS = [
    "", "*/*", "text/plain", "text/plain;version=0.0.4", "text/plain; version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=bogus", "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0", "application/openmetrics-text; version=0.0.1",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=2.0.0;escaping=values;q=0.9",
    # what Prometheus 2.x and 3.x send
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;"
    "version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "text/html, application/json", " application/openmetrics-text ; version=1.0.0 ",
    "application/openmetrics-text;version=1.x", "text/plain;version=x.y", "text/plain;version=",
]


def test_content_type_matches_prometheus_client_choose_encoder() -> None:
    for accept in ACCEPT_HEADERS:
        try:
            expected = text_exposition.choose_encoder(accept)[1]
        except TypeError:  # prometheus_client compares "1.x" with (1, 0, 0) and raises: ours serves the default
            assert encoder.content_type(accept) == encoder.TEXT_0_0_4, accept
            continue
        assert encoder.content_type(accept) == expected, accept
