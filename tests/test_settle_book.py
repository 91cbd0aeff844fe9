"""``core.settle.SpanBook``: a consumer's counters settled piece by piece at each energy-counter read (issue 28).

Pure arithmetic on plain values: spans built by hand (the GPU collector's ``EnergySpan``), owners as strings.
Each rule is a table of cases named after it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import pytest

from gpu_energy_exporter.core.settle import SpanBook, Split
from gpu_energy_exporter.core.state import EnergySpan, ProcessSample

INF = math.inf


def to(owner: str) -> Split[str]:
    """All of a piece to ``owner``."""
    return lambda joules, _w: [(owner, joules)]


def by_pid(owners: Mapping[int, str], fallback: str = "even") -> Split[str]:
    """A piece split by the per-process weights through ``owners`` (pid -> owner); without weights, to
    ``fallback``."""
    def parts(joules: float, w: Mapping[int, float] | None) -> list[tuple[str, float]]:
        if not w:
            return [(fallback, joules)]
        mine = {pid: w.get(pid, 0.0) for pid in owners}
        total = sum(mine.values())
        return [(owners[pid], joules * v / total) for pid, v in mine.items()]
    return parts


def span(anchor_at: float, anchor_j: float, raw_j: float, *, closed: tuple[float, float, float, bool] | None = None,
         samples: Sequence[ProcessSample] = (), scale: float = 1.0, whole: bool = True) -> EnergySpan:
    return EnergySpan(anchor_j, anchor_at, raw_j, whole, scale, closed, tuple(samples))


# ---- without a span: every delta settled at once


@pytest.mark.parametrize(("case", "readings", "want"), [
    ("the first reading is the baseline", [(0.0, 100.0)], {}),
    ("a delta to the owner", [(0.0, 100.0), (1.0, 150.0)], {"a": 50.0}),
    ("a counter that went back is rebased", [(0.0, 100.0), (1.0, 150.0), (2.0, 10.0), (3.0, 30.0)], {"a": 70.0}),
    ("a GPU not sampled: the next delta covers it", [(0.0, 0.0), (1.0, None), (2.0, 42.0)], {"a": 42.0}),
])
def test_without_a_span_each_delta_settles_at_once(case: str, readings: list[tuple[float, float | None]],
                                                    want: dict[str, float]) -> None:
    book: SpanBook[str] = SpanBook()
    got: dict[str, float] = {}
    for t, energy in readings:
        for k, v in book.update("g", t=t, energy_j=energy, span=None, segments=[(INF, to("a"))]).items():
            got[k] = got.get(k, 0.0) + v
    assert got == pytest.approx(want), case
    assert book.provisional("g") == {}


def test_without_a_span_an_edge_cuts_the_delta_by_time() -> None:
    book: SpanBook[str] = SpanBook()
    book.update("g", t=0.0, energy_j=0.0, span=None, segments=[(INF, to("a"))])
    got = book.update("g", t=1.0, energy_j=100.0, span=None, segments=[(0.25, to("a")), (INF, to("b"))])
    assert got == pytest.approx({"a": 25.0, "b": 75.0})
    # without times the first segment (the holders at the interval's start) takes the delta
    book.update("h", t=None, energy_j=0.0, span=None, segments=[(INF, to("a"))])
    assert book.update("h", t=None, energy_j=8.0, span=None, segments=[(0.5, to("a")), (INF, to("b"))]) == {"a": 8.0}


# ---- with a span: provisional until the read, then the counter's delta spread by the shape


def test_pieces_are_provisional_until_the_read_settles_them_by_the_shape() -> None:
    """Anchor at t=0 (1000 J); samples at 1, 2, 3 s with a raw shape of 100, 300, 100 J (scale 1.5), the
    first two pieces a's, the third b's; the read at 3 s says 1400 J: 400 J spread 80 / 240 / 80."""
    book: SpanBook[str] = SpanBook()
    assert book.update("g", t=0.0, energy_j=1000.0, span=span(0.0, 1000.0, 0.0), segments=[(INF, to("a"))]) == {}
    assert book.update("g", t=1.0, energy_j=1150.0, span=span(0.0, 1000.0, 100.0, scale=1.5),
                       segments=[(INF, to("a"))]) == {}
    assert book.update("g", t=2.0, energy_j=1600.0, span=span(0.0, 1000.0, 400.0, scale=1.5),
                       segments=[(INF, to("a"))]) == {}
    assert book.provisional("g") == pytest.approx({"a": 600.0})  # scale x raw, never settled
    got = book.update("g", t=3.0, energy_j=1400.0, span=span(3.0, 1400.0, 0.0, closed=(0.0, 1000.0, 500.0, True)),
                      segments=[(INF, to("b"))])
    assert got == pytest.approx({"a": 320.0, "b": 80.0})
    assert book.provisional("g") == {}


@pytest.mark.parametrize(("case", "whole", "raw", "want_a"), [
    ("shaped: by the power readings", True, (300.0, 100.0), 300.0),
    ("a gap in the readings: by time", False, (300.0, 100.0), 200.0),
    ("no shape at all: by time", True, (0.0, 0.0), 200.0),
])
def test_the_delta_is_spread_by_the_shape_only_where_it_is_whole(case: str, whole: bool, raw: tuple[float, float],
                                                                 want_a: float) -> None:
    book: SpanBook[str] = SpanBook()
    book.update("g", t=0.0, energy_j=0.0, span=span(0.0, 0.0, 0.0), segments=[(INF, to("a"))])
    book.update("g", t=2.0, energy_j=raw[0], span=span(0.0, 0.0, raw[0], whole=whole), segments=[(INF, to("a"))])
    got = book.update("g", t=4.0, energy_j=400.0, span=span(4.0, 400.0, 0.0, closed=(0.0, 0.0, sum(raw), whole)),
                      segments=[(INF, to("b"))])
    assert got == pytest.approx({"a": want_a, "b": 400.0 - want_a}), case


def test_an_edge_cuts_a_piece_and_its_shape_by_time() -> None:
    """An edge at 1.5 s inside the piece (1, 2]: a gets up to it, b after (the piece's shape shared by time)."""
    book: SpanBook[str] = SpanBook()
    book.update("g", t=0.0, energy_j=0.0, span=span(0.0, 0.0, 0.0), segments=[(INF, to("a"))])
    book.update("g", t=1.0, energy_j=100.0, span=span(0.0, 0.0, 100.0), segments=[(INF, to("a"))])
    got = book.update("g", t=2.0, energy_j=300.0, span=span(2.0, 300.0, 0.0, closed=(0.0, 0.0, 300.0, True)),
                      segments=[(1.5, to("a")), (INF, to("b"))])
    assert got == pytest.approx({"a": 200.0, "b": 100.0})


def test_each_piece_is_split_by_the_samples_over_it_else_by_the_last_weights() -> None:
    """Two processes: SM 75/25 over (0, 2], 25/75 over (2, 4] (the driver's means since the last ask); the
    piece (4, 5] has no sample: the weights known at its sample (pid 1 only) split it."""
    owners = {1: "a", 2: "b"}
    book: SpanBook[str] = SpanBook()
    book.update("g", t=0.0, energy_j=0.0, span=span(0.0, 0.0, 0.0), segments=[(INF, by_pid(owners))])
    for t in (2.0, 4.0):
        book.update("g", t=t, energy_j=100.0 * t, span=span(0.0, 0.0, 100.0 * t), segments=[(INF, by_pid(owners))])
    book.update("g", t=5.0, energy_j=500.0, span=span(0.0, 0.0, 500.0), segments=[(INF, by_pid(owners))],
                weights={1: 50.0})
    samples = [ProcessSample(1, 75.0, 0.0, 2.0), ProcessSample(2, 25.0, 0.0, 2.0),
               ProcessSample(1, 25.0, 2.0, 4.0), ProcessSample(2, 75.0, 2.0, 4.0)]
    got = book.update("g", t=6.0, energy_j=600.0,
                      span=span(6.0, 600.0, 0.0, closed=(0.0, 0.0, 600.0, True), samples=samples),
                      segments=[(INF, to("c"))])
    assert got == pytest.approx({"a": 150.0 + 50.0 + 100.0, "b": 50.0 + 150.0, "c": 100.0})


def test_a_book_started_inside_a_span_charges_nobody_for_the_part_before_it() -> None:
    book: SpanBook[str] = SpanBook()
    book.update("g", t=10.0, energy_j=500.0, span=span(0.0, 0.0, 250.0), segments=[(INF, to("a"))])
    got = book.update("g", t=20.0, energy_j=1000.0, span=span(20.0, 1000.0, 0.0, closed=(0.0, 0.0, 500.0, True)),
                      segments=[(INF, to("a"))])
    assert got == pytest.approx({"a": 500.0})  # half the shape was before the book's first sample


def test_a_span_closed_out_of_the_books_sight_is_charged_as_estimated() -> None:
    """A sample the book did not see read the counter (a new anchor): the pending pieces are charged their
    provisional parts (all that is known of them) and a new span opens."""
    book: SpanBook[str] = SpanBook()
    book.update("g", t=0.0, energy_j=0.0, span=span(0.0, 0.0, 0.0), segments=[(INF, to("a"))])
    book.update("g", t=1.0, energy_j=110.0, span=span(0.0, 0.0, 100.0, scale=1.1), segments=[(INF, to("a"))])
    got = book.update("g", t=3.0, energy_j=300.0, span=span(2.0, 250.0, 40.0), segments=[(INF, to("b"))])
    assert got == pytest.approx({"a": 110.0})
    assert book.provisional("g") == {}


def test_over_every_span_the_settled_parts_sum_to_the_counters_delta() -> None:
    """Random spans, shapes, edges and sample weights: whatever was provisional, the settled parts of each
    span add up to the counter's delta, and nothing is settled twice."""
    rng = random.Random(28)
    book: SpanBook[str] = SpanBook()
    owners = {1: "a", 2: "b", 3: "c"}
    t, total, anchor_t, anchor_j, raw = 0.0, 0.0, 0.0, 0.0, 0.0
    book.update("g", t=t, energy_j=total, span=span(0.0, 0.0, 0.0), segments=[(INF, to("a"))])
    settled = 0.0
    for _ in range(400):
        dt = rng.uniform(0.05, 1.5)
        t += dt
        total += rng.uniform(0.0, 700.0) * dt
        raw += rng.uniform(0.0, 900.0) * dt
        cut = t - rng.uniform(0.0, 2 * dt)
        segments = [(cut, by_pid(owners, rng.choice("abc"))), (INF, to(rng.choice("abc")))]
        if rng.random() < 0.1:
            samples = [ProcessSample(p, rng.uniform(0, 100), rng.uniform(anchor_t, t), t) for p in (1, 2, 3)]
            closed = (anchor_t, anchor_j, raw, rng.random() < 0.8)
            got = book.update("g", t=t, energy_j=total, span=span(t, total, 0.0, closed=closed, samples=samples),
                              segments=segments)
            assert sum(got.values()) == pytest.approx(total - anchor_j, rel=1e-9, abs=1e-6)
            settled += sum(got.values())
            anchor_t, anchor_j, raw = t, total, 0.0
        else:
            assert book.update("g", t=t, energy_j=total, span=span(anchor_t, anchor_j, raw), segments=segments) == {}
            assert sum(book.provisional("g").values()) == pytest.approx(raw)
    assert settled == pytest.approx(anchor_j, rel=1e-9)


def test_a_span_that_never_closes_is_charged_as_estimated_in_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter that cannot be read: past ``MAX_PIECES`` pending pieces the estimate is charged, and the read
    that finally closes the span settles only the part after (the part before is charged already)."""
    import gpu_energy_exporter.core.settle as settle

    monkeypatch.setattr(settle, "MAX_PIECES", 4)
    book: SpanBook[str] = SpanBook()
    book.update("g", t=0.0, energy_j=0.0, span=span(0.0, 0.0, 0.0), segments=[(INF, to("a"))])
    got: dict[str, float] = {}
    for t in range(1, 6):
        for k, v in book.update("g", t=float(t), energy_j=100.0 * t, span=span(0.0, 0.0, 100.0 * t),
                                segments=[(INF, to("a"))]).items():
            got[k] = got.get(k, 0.0) + v
    assert got == pytest.approx({"a": 500.0}) and book.provisional("g") == {}
    final = book.update("g", t=6.0, energy_j=660.0, span=span(6.0, 660.0, 0.0, closed=(0.0, 0.0, 600.0, True)),
                        segments=[(INF, to("b"))])
    assert final == pytest.approx({"b": 110.0})  # the last piece's share of the span's 660 J
