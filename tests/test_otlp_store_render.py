"""The training store's render (issue 15): each family's encoded lines are kept in one list in series order
(``series.SeriesMap``), stored by the pushing thread, and a scrape copies those lists under the lock.

What must hold whatever the order of pushes, removals and renders: the bytes served equal a fresh encode of
what ``collect()`` returns (so the order of series is the order a fresh encode gives), a series past its TTL
or ended by a point without a value disappears, a removed series' place is reused without growing the lists
for ever, and an encoding made for older values never replaces the lines of newer ones.
"""

from __future__ import annotations

from helpers import registry_of
from prometheus_client import exposition as text_exposition
from prometheus_client.openmetrics import exposition as om_exposition

from gpu_energy_exporter.otlp import series as series_mod
from gpu_energy_exporter.otlp.points import Batch, Labels, Point, series_bytes
from gpu_energy_exporter.otlp.store import TrainingStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _point(kind: str, name: str, labels: dict[str, str], t: int, **kw: object) -> Point:
    key: Labels = tuple(sorted(labels.items()))
    p = Point(kind, name, f"help of {name}", "", key, labels.get("run_id", ""), 1, t, **kw)  # type: ignore[arg-type]
    p.cost = series_bytes(name, key, kind, buckets=len(p.counts), quantiles=len(p.quantiles))
    return p


def _gauge(name: str, rank: int, value: float, t: int, **kw: object) -> Point:
    return _point("gauge", name, {"run_id": "r", "rank": str(rank)}, t, value=value, **kw)


def _fresh(store: TrainingStore, openmetrics: bool) -> bytes:
    registry = registry_of(store.collect())
    if openmetrics:
        return om_exposition.generate_latest(registry).removesuffix(b"# EOF\n")
    return text_exposition.generate_latest(registry)


def _check(store: TrainingStore) -> None:
    for om in (False, True):
        assert store.render(om) == _fresh(store, om), f"openmetrics={om}"


def _ranks(body: bytes, name: str) -> list[str]:
    prefix = name.encode() + b"{"
    return [line.split(b'rank="')[1].split(b'"')[0].decode() for line in body.splitlines()
            if line.startswith(prefix)]


def test_after_a_push_changing_some_series_the_bytes_equal_a_fresh_encode() -> None:
    store = TrainingStore()
    t = 10**18
    store.apply(Batch(points=[_gauge("loss", r, 1.0, t) for r in range(20)]
                      + [_gauge("ns:lr", r, 0.5, t) for r in range(5)], received=25))
    _check(store)
    before = store.render(False)
    # one series changed: only its line differs, every other line and the order stay
    store.apply(Batch(points=[_gauge("loss", 7, 2.5, t + 1)], received=1))
    after = store.render(False)
    assert after != before
    assert b'loss{rank="7",run_id="r"} 2.5\n' in after
    assert [x for x in after.splitlines() if b'rank="7"' not in x and b"otlp" not in x] == \
           [x for x in before.splitlines() if b'rank="7"' not in x and b"otlp" not in x]
    _check(store)
    # every series changed, in another order than they were added
    store.apply(Batch(points=[_gauge("loss", r, 3.0 + r, t + 2) for r in reversed(range(20))], received=20))
    assert _ranks(store.render(False), "loss") == [str(r) for r in range(20)]
    _check(store)


def test_order_is_kept_through_removals_compaction_and_re_adds() -> None:
    store = TrainingStore()
    t = 10**18
    store.apply(Batch(points=[_gauge("loss", r, float(r), t) for r in range(40)], received=40))
    # end 30 of them (points without a value): enough holes to compact the family's lines
    store.apply(Batch(points=[_gauge("loss", r, 0.0, t + 1, no_value=True) for r in range(0, 40) if r % 4],
                      received=30))
    fam = store._families["loss"]
    assert len(fam.series.lines[0]) < 40  # compacted: the lists do not keep a place per removed series
    assert _ranks(store.render(False), "loss") == [str(r) for r in range(0, 40, 4)]
    _check(store)
    # a removed series pushed again comes back last, as a fresh encode orders it
    store.apply(Batch(points=[_gauge("loss", 1, 9.0, t + 2), _gauge("loss", 8, 8.5, t + 2)], received=2))
    assert _ranks(store.render(False), "loss") == [*(str(r) for r in range(0, 40, 4)), "1"]
    _check(store)
    for s in fam.series.values():
        assert fam.series.lines[0][s.pos] is not None


def test_churn_keeps_the_lines_bounded() -> None:
    store = TrainingStore()
    t = 10**18
    for i in range(300):
        points = [_gauge("loss", i, 1.0, t + i)]
        if i >= 3:
            points.append(_gauge("loss", i - 3, 0.0, t + i, no_value=True))
        store.apply(Batch(points=points, received=len(points)))
    lines = store._families["loss"].series.lines[0]
    assert len(lines) <= 2 * 3 + 9
    assert _ranks(store.render(False), "loss") == ["297", "298", "299"]
    _check(store)


def test_a_series_past_its_ttl_disappears_from_the_render() -> None:
    clock = Clock()
    store = TrainingStore(series_ttl=60.0, clock=clock)
    t = 10**18
    store.apply(Batch(points=[_gauge("loss", r, 1.0, t) for r in range(3)], received=3))
    rendered = store.render(False)
    assert _ranks(rendered, "loss") == ["0", "1", "2"]
    clock.now += 30
    store.apply(Batch(points=[_gauge("loss", 1, 2.0, t + 1)], received=1))
    clock.now += 31  # ranks 0 and 2 are past the TTL, rank 1 is not
    assert _ranks(store.render(False), "loss") == ["1"]
    _check(store)
    clock.now += 61
    assert b"loss{" not in store.render(False)
    _check(store)


def test_an_older_encoding_never_replaces_newer_lines() -> None:
    store = TrainingStore()
    t = 10**18
    store.apply(Batch(points=[_gauge("loss", 0, 1.0, t)], received=1))
    fam = store._families["loss"]
    s = next(iter(fam.series.values()))
    old = series_mod.encode_changed([(s, s.heads, s.values)])
    store.apply(Batch(points=[_gauge("loss", 0, 2.0, t + 1)], received=1))
    # the first request's encoding arrives late, after the second push published its own
    series_mod.publish(old)
    assert b'loss{rank="0",run_id="r"} 2.0\n' in store.render(False)
    _check(store)


def test_a_render_between_a_push_and_its_publication_serves_the_previous_lines(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = TrainingStore()
    t = 10**18
    store.apply(Batch(points=[_gauge("loss", 0, 1.0, t)], received=1))
    seen: list[bytes] = []
    publish = store._publish

    def late(changed):  # type: ignore[no-untyped-def]
        seen.append(store.render(False))  # a scrape while the request is still encoding
        publish(changed)

    monkeypatch.setattr(store, "_publish", late)
    store.apply(Batch(points=[_gauge("loss", 0, 2.0, t + 1), _gauge("loss", 1, 5.0, t + 1)], received=2))
    assert _ranks(seen[0], "loss") == ["0"] and b"} 1.0\n" in seen[0]
    # once published, the family's cached block is not served any more
    assert _ranks(store.render(False), "loss") == ["0", "1"]
    _check(store)
