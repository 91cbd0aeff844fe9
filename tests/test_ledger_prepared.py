"""The run ledger's /metrics bytes prepared on the sampler thread (``engine.exposition.PreparedSource``):
what a scrape serves is what a fresh encode of ``RunLedger.collect()`` gave at the latest snapshot, in
each format; a scrape that finds the bytes ready collects nothing, and they are prepared only ahead of a
scrape expected from the scrapes' period (not at every sample).

Same real snapshots, points and injected clock as tests/test_ledger.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric
from test_ledger import T0, UUID_A, UUID_B, Clock, Harness, constant, point

from gpu_energy_exporter.engine.exposition import PreparedSource, encode
from gpu_energy_exporter.ledger import RunLedger


class Prepared:
    """A ledger and its prepared source, snapshots followed by ``prepare`` as the sampler's listeners run."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.ledger = RunLedger(None, warmup_s=5.0, stale_after_s=300.0, clock=self.clock)
        self.collects = 0
        self.source = PreparedSource(self._collect, self.ledger.version, clock=self.clock, wanted_for=60.0)
        self.h = Harness(self.ledger, self.clock, {UUID_A: constant(300.0), UUID_B: constant(200.0)})

    def _collect(self) -> Iterable[Metric]:
        self.collects += 1
        return self.ledger.collect()

    def snap(self, t: float) -> None:
        self.h.snap_at(t)
        self.source.prepare()

    def export(self, run_id: str, t: float, gpu: str) -> None:
        self.h.push(point(run_id, "training_tokens_total", 1000.0 * (t - T0), t, "0", gpu))
        self.h.push(point(run_id, "training_steps_total", float(int(t - T0)), t, "0", gpu))

    def fresh(self, openmetrics: bool) -> bytes:
        return encode(self.ledger.collect(), openmetrics)


def test_served_bytes_are_a_fresh_encode_as_of_the_latest_snapshot() -> None:
    p = Prepared()
    p.export("a", T0 + 0.5, UUID_A)
    p.export("b", T0 + 0.5, UUID_B)
    assert p.source.render(False) == p.fresh(False)  # no bytes yet: the first scrape encodes them itself
    assert p.source.render(True) == p.fresh(True)
    for i in range(1, 20):
        p.export("a", T0 + i - 0.5, UUID_A)
        p.export("b", T0 + i - 0.3, UUID_B)
        p.snap(T0 + i)
        for om in (False, True):
            body = p.source.render(om)
            assert body == p.fresh(om), (i, om)
            assert b'gpuenergy_run_tokens_total{run_id="a"}' in body
    # A push between two snapshots shows at the next one: until then the bytes of the latest snapshot.
    before = p.source.render(False)
    p.export("a", T0 + 19.5, UUID_A)
    assert p.source.render(False) == before
    assert p.fresh(False) != before
    p.snap(T0 + 20)
    assert p.source.render(False) == p.fresh(False) != before


def test_a_scrape_that_finds_the_bytes_ready_collects_nothing() -> None:
    """A scraper every second (the sampling interval): from its second scrape on, its format is prepared at
    every snapshot and every scrape finds the bytes ready; a second format joins the same collect."""
    p = Prepared()
    p.export("a", T0 + 0.5, UUID_A)
    p.snap(T0 + 1)
    assert p.collects == 0  # no scrape asked for a format yet: nothing prepared
    p.source.render(True)
    assert p.collects == 1  # the first scrape encodes its bytes itself
    p.export("a", T0 + 1.5, UUID_A)
    p.snap(T0 + 2)
    assert p.collects == 1  # one scrape: its period is not known yet, nothing prepared
    p.source.render(True)
    assert p.collects == 2  # bytes of an older snapshot: encoded by the scrape, as of now
    p.export("a", T0 + 2.5, UUID_A)
    p.snap(T0 + 3)
    assert p.collects == 3  # a scrape a second after the last one is expected: prepared
    for _ in range(3):
        p.source.render(True)
    assert p.collects == 3
    p.source.render(False)  # a new format: encoded by that scrape
    assert p.collects == 4
    p.export("a", T0 + 3.5, UUID_A)
    p.snap(T0 + 4)
    assert p.collects == 5  # OpenMetrics prepared; the text format's period is not known yet
    p.source.render(False)
    p.source.render(True)
    assert p.collects == 6  # the text scrape encoded its own
    p.export("a", T0 + 4.5, UUID_A)
    p.snap(T0 + 5)
    assert p.collects == 7  # both formats expected now: one collect for both
    p.source.render(False)
    p.source.render(True)
    assert p.collects == 7


def test_a_scrape_every_15_s_is_prepared_for_ahead_and_never_waits() -> None:
    """Prometheus scraping every 15 s, the sampler every second: the ledger is collected at the two samples
    before each expected scrape, not at every sample, and every scrape after the first two finds the bytes of
    the latest snapshot ready (equal to a fresh encode as of it)."""
    p = Prepared()
    t = T0
    collects_at_scrapes = []
    for i in range(1, 121):
        t = T0 + i
        p.export("a", t - 0.5, UUID_A)
        p.snap(t)
        if i % 15 == 0:
            before = p.collects
            assert p.source.render(False) == p.fresh(False), i
            collects_at_scrapes.append(p.collects - before)
    assert collects_at_scrapes[:2] == [1, 1]  # the first scrape, and the second before the period is known
    assert collects_at_scrapes[2:] == [0] * 6  # prepared ahead, served ready
    # from the third scrape on: prepared at the samples 13 and 14 s after a scrape and at the scrape's own
    # (a scrape is expected within two samples of each), for the six scrape periods that follow
    assert p.collects == 2 + 3 * 6


def test_a_scrape_off_its_rhythm_encodes_itself_as_of_now() -> None:
    """A scrape that comes before it is expected finds bytes of an older snapshot: it encodes them itself,
    never serves them stale."""
    p = Prepared()
    for i in range(1, 62):
        p.export("a", T0 + i - 0.5, UUID_A)
        p.snap(T0 + i)
        if i in (15, 30, 45, 60):
            p.source.render(False)
    p.export("a", T0 + 61.5, UUID_A)
    p.snap(T0 + 62)  # 2 s after a scrape: the next is expected at 75
    before = p.collects
    assert p.source.render(False) == p.fresh(False)  # an extra scraper, or someone's curl
    assert p.collects == before + 1


def test_a_format_nobody_asks_for_is_no_longer_prepared_nor_served_stale() -> None:
    p = Prepared()
    p.export("a", T0 + 0.5, UUID_A)
    p.snap(T0 + 1)
    p.source.render(False)
    t = T0 + 1
    while t < T0 + 70:  # wanted_for is 60 s: the scrapes stopped
        t += 1.0
        p.export("a", t - 0.5, UUID_A)
        p.snap(t)
    collects = p.collects
    p.snap(t + 1)
    assert p.collects == collects, "still preparing a format nobody asked for"
    assert p.source.render(False) == p.fresh(False)  # encoded afresh, not the old bytes


def test_counters_never_go_down_across_prepared_and_scrape_encodes() -> None:
    """The served counters come from one ``collect()`` at a time: a scrape's own encode never stores
    older bytes over a prepare's."""
    p = Prepared()
    p.export("a", T0 + 0.5, UUID_A)
    p.snap(T0 + 1)
    served: list[float] = []
    for i in range(2, 12):
        p.export("a", T0 + i - 0.5, UUID_A)
        p.snap(T0 + i)
        for line in p.source.render(i % 2 == 0).decode().splitlines():
            if line.startswith('gpuenergy_run_energy_joules_total{run_id="a"}'):
                served.append(float(line.split()[-1]))
    assert len(served) == 10 and served == sorted(served) and served[-1] > served[0]
