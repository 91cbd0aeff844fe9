"""What the run ledger serves: live and closed runs' figures for the JSON API (``runs``, ``run``) and the
per-run series and self-metrics for /metrics (``collect``).

``LedgerViews`` is the reading half of ``ledger.RunLedger`` (which inherits it): it reads the ledger's state
under the ledger's lock and never changes a run's accounts (it only settles recounts owed, ``_recount``,
before reading). Figures come from ``summary``; series from ``specs``. Never does I/O, never calls NVML.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpu_energy_exporter.core.runs_schema import SUMMARY_SCHEMA
from gpu_energy_exporter.ledger import accounting, clients, restart, runs, serving, specs
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.snapshot_frames import Frame
from gpu_energy_exporter.ledger.split import Holding
from gpu_energy_exporter.ledger.summary import (
    details,
    local_check,
    peak_flops,
    peak_row,
    summarize,
    summary_path,
    with_provisional,
)


class LedgerViews:
    """The ledger's reads (see the module docstring); the state is ``RunLedger``'s."""

    csv_path: str | None
    warmup_s: float
    _carbon: Callable[[], Any] | None
    _clock: Callable[[], float]
    _lock: threading.RLock
    _history: deque[Frame]
    _active: dict[str, Run]
    _closed: list[Run]
    _finished_counts: dict[str, float]
    _rejected: float
    _evicted: float
    _write_errors: float
    _pending: Mapping[int, Any]  # rows not yet written (ledger.filewriter.Row by sequence)
    _unattributed: dict[str, tuple[str, str, float]]
    _claims: specs.ClaimTally
    _durable: restart.Durable
    _clients: clients.ClientBounds
    _snapshots: int
    _holders_gen: int
    _expirations: int
    _anchors: dict[str, float]

    # RunLedger's (the driver's) own
    def _recount(self) -> None:
        raise NotImplementedError

    def _expire(self, now: float) -> None:
        raise NotImplementedError

    def _holders(self, frame: Frame) -> Mapping[str, Sequence[Holding]]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------
    # figures

    def _live_summary(self, run: Run) -> dict[str, Any]:
        """An active run's figures cut at its last point: counters are only known as of the last export,
        so counting energy up to the latest snapshot would charge the tokens of the last export interval
        for energy they have not been reported against yet (J/token too high by up to one interval). With
        the parts of its energy, window energy and CO2 that no counter read has settled yet
        (``with_provisional``).

        Kept until the run's stamp changes: a point of the run, a snapshot, or a change of who holds which
        GPU (which recounts runs sharing them); so a scrape recounts only the runs that changed. Returns a
        copy (callers may change it)."""
        stamp = (run.changes, self._snapshots, self._holders_gen, self._expirations)
        memo = run.live_memo
        if memo is None or memo[0] != stamp:
            live = self._live_summary_now(run)
            memo = run.live_memo = (stamp, with_provisional(live, self._settled_summary(run, live)))
        return dict(memo[1])

    def _live_summary_now(self, run: Run) -> dict[str, Any]:
        cut = run.last_point_t
        if run.e is None and run.s < cut < run.acc.t:
            base = run.checkpoint_before(cut)
            if base is not None:
                acc = base.copy()
                runs.replay(run, acc, self._history, max(acc.t, run.s), cut, self._holders, live=False)
                acc.t = cut
                return self._summary(run, acc)
        return self._summary(run)

    def _summary(self, run: Run, acc: accounting.Acc | None = None, as_of: float | None = None) -> dict[str, Any]:
        latest = self._history[-1] if self._history else None
        precision = run.metadata.get("precision") or ""
        return serving.figures(run, summarize(
            run, run.acc if acc is None else acc, warmup_s=self.warmup_s, local=local_check(latest),
            carbon_configured=self._carbon is not None, peak=peak_flops(run.gpus, latest, precision, peak_row),
            summary_file=summary_path(self.csv_path, run.run_id), xids=latest.xid_events if latest else (),
            as_of=as_of))

    def _settled_time(self, run: Run, cap: float | None = None) -> float:
        """Up to when the run's figures are settled: the earliest last counter read of its GPUs (frame clock),
        no later than ``cap`` (default: its last point, counters being known up to then) nor the latest
        snapshot."""
        latest = self._history[-1] if self._history else None
        if latest is None:
            return run.s
        t = min(run.last_point_t if cap is None else cap, latest.t)
        for key in run.parents(latest):
            g = latest.gpus.get(key)
            if g is not None and g.span is not None:
                t = min(t, self._anchors.get(key, run.s))
        return max(t, run.s)

    def _settled_summary(self, run: Run, live: dict[str, Any] | None = None) -> dict[str, Any]:
        """An active run's figures as of its settled time (``_settled_time``): energy, CO2 and every counter
        (tokens, steps, samples, FLOPs, active seconds) cut at that one instant, so the counters /metrics
        serves describe the same interval and any ratio of their increases (J/token, tokens/s) is right; they
        lag by at most one --collector.energy-interval. Kept with the live summary's stamp. ``live``: the
        run's live figures (without their provisional parts), when the caller has them."""
        stamp = (run.changes, self._snapshots, self._holders_gen, self._expirations)
        memo = getattr(run, "settled_memo", None)
        if memo is not None and memo[0] == stamp:
            return memo[1]
        t = self._settled_time(run)
        live_t = run.last_point_t if run.s < run.last_point_t < run.acc.t else run.acc.t  # _live_summary_now's cut
        if t >= live_t:
            summary = live if live is not None else self._live_summary_now(run)  # settled as far as it goes
        else:
            summary = self._summary_as_of(run, t)
        run.settled_memo = (stamp, summary)
        return summary

    def _summary_as_of(self, run: Run, t: float) -> dict[str, Any]:
        """The run's figures as they stood at ``t`` (energy replayed from the last checkpoint before it, each
        counter interpolated there)."""
        base = run.checkpoint_before(t)
        acc = base.copy() if base is not None else accounting.Acc(t=run.s)
        if acc.t < t:
            runs.replay(run, acc, self._history, max(acc.t, run.s), t, self._holders, live=False)
        acc.t = t
        summary = self._summary(run, acc, as_of=t)
        latest = self._history[-1] if self._history else None
        if summary.get("energy_j") is None and acc.expected_gpu_s == 0 and run.parents(latest) & set(
                latest.gpus if latest else ()):
            # Nothing settled yet on GPUs of this node: the counters start at zero, all together, so that no
            # rate() loses a first interval (a series that first appears at a value counts none of it).
            summary.update(energy_j=0.0, window_energy_j=0.0, co2_g=0.0 if self._carbon is not None else None)
        return summary

    def _document(self, run: Run, summary: dict[str, Any]) -> dict[str, Any]:
        """A run's document (``/api/v1/run``, the JSON summary): its summary, GPUs, metadata and timeline."""
        return {"schema": SUMMARY_SCHEMA, "start_unix": run.s, "end_unix": run.e,
                "configured_warmup_s": self.warmup_s, **summary, **details(run), **serving.document(run, summary)}

    # ------------------------------------------------------------------------------------------------
    # reading

    def runs(self) -> list[dict[str, Any]]:
        """Active and recently finished runs (summaries, oldest first); active ones are figured now."""
        with self._lock:
            self._recount()
            out = [dict(r.summary) for r in self._closed if r.summary is not None]
            out.extend(self._live_summary(r) for r in self._active.values() if not r.tentative)
        out.sort(key=lambda s: s["start_time"] or "")
        return out

    def run(self, run_id: str) -> dict[str, Any] | None:
        """One run's summary plus its GPUs, metadata and timeline; the active instance if there is one."""
        with self._lock:
            self._recount()
            run = self._active.get(run_id)
            if run is None or run.tentative:
                closed = [r for r in self._closed if r.run_id == run_id]
                if not closed:
                    return None
                run = closed[-1]
            summary = dict(run.summary) if run.summary is not None else self._live_summary(run)
            return self._document(run, summary)

    def collect(self) -> list[Metric]:
        """Per-run series and the ledger's self-metrics (a live source of the /metrics collector)."""
        with self._lock:
            self._recount()
            self._expire(self._clock())
            # A closed run and a resumed instance of it share the run id: show only the newest.
            by_id: dict[str, tuple[Run, dict[str, Any]]] = {}
            for r in self._closed:
                if r.summary is not None:
                    by_id[r.run_id] = (r, r.summary)
            settled: dict[str, Mapping[str, Any]] = {}
            for r in self._active.values():
                if not r.tentative:
                    by_id[r.run_id] = (r, self._live_summary(r))
                    settled[r.run_id] = self._settled_summary(r)
            # Counters as of the run's settled time (a closed run's are all settled), gauges live (with the
            # provisional energy: what the live figures add to the settled ones).
            served = [(run_id, r.status, s, specs.counter_values(r.exposed, settled.get(run_id, s), self.warmup_s))
                      for run_id, (r, s) in by_id.items()]
            finished = dict(self._finished_counts)
            rejected, errors, evicted = self._rejected, self._write_errors, self._evicted
            pending = len(self._pending)
            backlog = self._durable.backlog_s()
            unattributed = sorted(self._unattributed.values(), key=lambda x: (len(x[0]), x[0], x[1]))
            tally = self._claims.counts((r.unconfirmed.values() for r in self._active.values()),
                                        self._history[-1] if self._history else None, self._holders)
            refused = dict(self._clients.refused)
            lost = dict(self._durable.losses.counts)
        return [*specs.families(served, finished, rejected, errors, evicted, pending, unattributed, backlog, tally),
                specs.refused_family(refused), specs.state_lost_family(lost)]
