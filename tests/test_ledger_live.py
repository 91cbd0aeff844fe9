"""The ledger's scrape-time cost: an active run's live summary is kept until something it depends on
changes, and the kept figures are those a fresh count gives.

Same real snapshots, points and injected clock as tests/test_ledger.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.core import Metric
from test_ledger import T0, UUID_A, UUID_B, Clock, Harness, bursty, constant, point, summary_of

from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.accounting import Acc
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.summary import with_provisional


class CountingLedger(RunLedger):
    """Counts how many summaries it builds (the expensive part of a scrape)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.summaries = 0

    def _summary(self, run: Run, acc: Acc | None = None, as_of: float | None = None) -> dict[str, Any]:
        self.summaries += 1
        return super()._summary(run, acc, as_of)


class FreshLedger(RunLedger):
    """Counts every live summary afresh at every call (the slow way, kept nothing between scrapes)."""

    def _live_summary(self, run: Run) -> dict[str, Any]:
        live = self._live_summary_now(run)
        run.settled_memo = None  # nothing kept: the settled figures afresh too
        return with_provisional(live, self._settled_summary(run, live))


def _export(h: Harness, run_id: str, t: float, rank: str = "0", gpu: str = UUID_A) -> None:
    h.push(point(run_id, "training_tokens_total", 1000.0 * (t - T0), t, rank, gpu))
    h.push(point(run_id, "training_steps_total", float(int(t - T0)), t, rank, gpu))


def test_a_second_collect_with_nothing_changed_builds_no_summary() -> None:
    clock = Clock()
    ledger = CountingLedger(None, warmup_s=5.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(300.0), UUID_B: constant(200.0)})
    _export(h, "a", T0 + 0.5, gpu=UUID_A)
    _export(h, "b", T0 + 0.5, gpu=UUID_B)
    for i in range(1, 40):
        h.snap_at(T0 + i)
        _export(h, "a", T0 + i + 0.5, gpu=UUID_A)  # the last point falls between snapshots: a replay
        _export(h, "b", T0 + i + 0.5, gpu=UUID_B)
    h.snap_at(T0 + 40)
    first = ledger.collect()
    assert ledger.summaries == 2  # one per run
    second = ledger.collect()
    assert ledger.summaries == 2, "nothing changed, yet collect() recounted the runs"
    assert _samples(second) == _samples(first)
    assert ledger.runs() == ledger.runs()  # the API reads the kept summaries too
    assert ledger.summaries == 2
    # One rank of run "a" exports: only "a" is recounted.
    _export(h, "a", T0 + 40.5, gpu=UUID_A)
    ledger.collect()
    assert ledger.summaries == 3
    # A snapshot changes every run's figures.
    h.snap_at(T0 + 41)
    ledger.collect()
    assert ledger.summaries == 5


def test_a_caller_changing_a_summary_does_not_change_the_kept_one() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=5.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(300.0)})
    _export(h, "a", T0 + 0.5)
    h.snap_at(T0 + 1)
    h.snap_at(T0 + 2)
    [summary] = ledger.runs()
    energy = summary["energy_j"]
    summary["energy_j"] = -1.0
    assert ledger.runs()[0]["energy_j"] == energy


def _samples(metrics: list[Metric]) -> list[tuple[str, str, tuple[tuple[str, str], ...], float]]:
    return sorted((m.name, s.name, tuple(sorted(s.labels.items())), s.value) for m in metrics for s in m.samples)


def test_kept_live_figures_equal_a_fresh_count_after_many_exports() -> None:
    """Two ledgers fed the same snapshots and points, scraped after every step: one keeps live summaries
    between scrapes, the other counts them afresh every time. Runs share GPUs, a run joins late (the
    others are recounted with the new split), one finishes and expires, ranks export between snapshots."""
    clocks = [Clock(), Clock()]
    ledgers = [RunLedger(None, warmup_s=10.0, stale_after_s=300.0, clock=clocks[0], keep_finished_s=20.0),
               FreshLedger(None, warmup_s=10.0, stale_after_s=300.0, clock=clocks[1], keep_finished_s=20.0)]
    traces = {UUID_A: bursty(mean=400.0, amplitude=300.0, period=3.0), UUID_B: constant(250.0)}
    hs = [Harness(ledger, clock, traces) for ledger, clock in zip(ledgers, clocks, strict=True)]
    compared = 0

    def step(action: Any) -> None:
        nonlocal compared
        for h in hs:
            action(h)
        kept, fresh = (_samples(ledger.collect()) for ledger in ledgers)
        assert kept == fresh
        assert ledgers[0].runs() == ledgers[1].runs()
        compared += 1

    step(lambda h: _export(h, "a", T0 + 0.2, "0", UUID_A))
    step(lambda h: _export(h, "a", T0 + 0.2, "1", UUID_B))
    for i in range(1, 200):
        t = T0 + i
        step(lambda h, t=t: h.snap_at(t))
        step(lambda h, t=t: _export(h, "a", t + 0.4, "0", UUID_A))  # rank 0 every second
        if i % 3 == 0:
            step(lambda h, t=t: _export(h, "a", t + 0.7, "1", UUID_B))  # rank 1 every third second
        if i == 60:  # run "b" starts on GPU A, its first point stamped before the last snapshots: "a"
            # shares the GPU from then on and is recounted with the split, with no point or snapshot of its own
            step(lambda h, t=t: _export(h, "b", t - 5.5, "0", UUID_A))
        if 60 < i < 120 and i % 4 == 0:
            step(lambda h, t=t: _export(h, "b", t + 0.3, "0", UUID_A))
        if i == 120:  # "b" finishes; kept for keep_finished_s, then expires
            step(lambda h, t=t: h.push(point("b", "training_run_finished", 1, t + 0.3, "0", UUID_A)))
        if i == 150:  # a late point: "a" names a GPU again, a loss (only its gauges change)
            step(lambda h, t=t: h.push(point("a", "training_loss", 2.5, t + 0.5, "0", UUID_A)))
    assert compared > 450
    final = ledgers[0].runs()
    assert [s["run_id"] for s in final] == ["a"]  # "b" finished and expired
    assert final[0]["energy_j"] > 0 and final[0]["energy_split"] == "even,exclusive"


def test_a_quiet_runs_live_figures_stay_put_after_its_start_left_the_snapshot_history() -> None:
    """A run that stops pushing is figured up to its last point. Once that point is older than the late
    window's checkpoints, the count restarts from the checkpoint before the last point; it used to restart
    from the run's start, whose snapshots had left the history: energy silently went missing."""
    clock = Clock()
    ledger = RunLedger(None, warmup_s=5.0, stale_after_s=150.0, late_window_s=20.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(300.0)})
    for i in range(200):
        _export(h, "a", T0 + i + 0.5)
        h.snap_at(T0 + i + 1)
    quiet = summary_of(ledger, "a")
    assert quiet["energy_j"] == pytest.approx(300.0 * 199.0)
    for i in range(201, 300):  # quiet for 100 s: not stale yet (150 s), past the late window (20 s)
        h.snap_at(T0 + i)
        now = summary_of(ledger, "a")
        assert now["status"] == "running"
        assert (now["energy_j"], now["tokens"], now["duration_s"]) == (
            quiet["energy_j"], quiet["tokens"], quiet["duration_s"]), f"at {i} s"
