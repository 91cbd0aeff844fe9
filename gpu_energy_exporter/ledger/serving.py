"""Serving sessions in the run ledger: a local inference server's process lifetime is a run of kind ``serving``,
charged its GPUs' settled share exactly as a training run's processes are.

Each snapshot carries the sessions the inference collector found (``Snapshot.serving``: the server's listening
process and its descendants, the engine, per model the prompt and output tokens and requests as the server's
/metrics last said). A session seen for the first time opens a run (id ``serving-<port>-<pid>``, ``.<n>`` after
the n-th counter reset) at its first scrape, or at its process's start when it started while the exporter
watched, never before the previous snapshot. Its processes are the run's (``Run.procs``: the listener and its
descendants, so a GPU that also runs a training process is split by their SM use, ``split``), its GPUs those
NVML lists them on (added as they appear: the workers start after the API server), its tokens the run's
``training_tokens_total`` series, one per model, output tokens only (J/token is J per output token); prompt
tokens and requests are kept here. A session the collector no longer lists (the server is gone, or restarted)
ends at its last scrape.

Per hour (UTC) the session keeps prompt and output tokens, requests, energy, idle energy and CO2: the tokens
of each scrape go to the hour the scrape fell in, the energy counted up to each snapshot to the hour it was
counted in; at the end the hours are squared with the session's totals (what a recount or a settlement
moved lands in the last hour). An hour without output tokens has its idle energy and no J per output token.

The driver (``ledger.RunLedger.on_snapshot``) calls ``track`` under its lock on the sampler thread, and its
views call ``figures`` and ``document``. Pure bookkeeping on the ledger's runs: no I/O, no NVML, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.core.state import ServingSession
from gpu_energy_exporter.ledger import points, runs
from gpu_energy_exporter.ledger.files import iso_utc
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.snapshot_frames import Frame

KIND_SERVING, KIND_TRAINING = "serving", "training"
RUN_ID_PREFIX = "serving-"
_PROMPT, _OUTPUT, _REQ, _ENERGY, _IDLE, _CO2 = range(6)
HOUR = 3600.0


@dataclass
class ServingState:
    """What a serving run keeps besides a run's state (``Run.serving``; saved with it)."""

    key: str = ""
    url: str = ""
    engine: str = ""
    pid: int = 0
    #: model -> [prompt tokens, requests] at its first scrape (the baselines) and now
    models: dict[str, list[float]] = field(default_factory=dict)
    #: hour start (Unix seconds, as text) -> [prompt, output, requests, energy J, idle J, CO2 g]
    hours: dict[str, list[float]] = field(default_factory=dict)
    counted: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # energy, idle, CO2 put in hours
    last_scrape: float = -math.inf  # wall clock of the last scrape taken in


def run_id_of(session: ServingSession) -> str:
    return RUN_ID_PREFIX + session.key


def track(ledger: Any, sessions: tuple[ServingSession, ...] | None, prev: Frame | None, frame: Frame,
          wall: float) -> bool:
    """Open, feed and end the serving runs for one snapshot (``frame``, whose time is ``wall`` on the wall
    clock), before the ledger advances its runs over it. ``sessions`` None (no inference collector) changes
    nothing. Returns whether a run was opened."""
    if sessions is None:
        return False
    active: dict[str, Run] = ledger._active
    listed = {run_id_of(s): s for s in sessions}
    lo = max(prev.t if prev is not None else -math.inf, frame.t - ledger._max_backdate_s)

    def on_frame(t: float) -> float:
        return min(frame.t, frame.t - (wall - t))

    opened = False
    for run_id, s in listed.items():
        run = active.get(run_id)
        if run is not None and run.serving is None:
            continue  # a training run pushed under this id: never taken over
        if run is None:
            run = _open(ledger, run_id, s, max(lo, on_frame(s.start)))
            if run is None:
                continue
            opened = True
        _count_energy(run)
        _take_scrape(run, s, on_frame)
        run.last_point_received = max(run.last_point_received, frame.t)  # listed: never stale
        _take_gpus(ledger, run, s, frame)
    for run in list(active.values()):
        if run.serving is not None and run.run_id not in listed and run.e is None:
            _count_energy(run)
            run.e = max(run.s, min(run.last_point_t, frame.t))  # gone: at its last scrape
            run.status = "finishing"
            ledger._holders_changed(run, run.e)
    return opened


def _open(ledger: Any, run_id: str, s: ServingSession, start: float) -> Run | None:
    if len(ledger._active) >= ledger._max_active:
        ledger._rejected += 1
        return None
    run = Run(run_id, start, 0.0, True, ledger._timeline_points, start)
    run.fresh = False  # counters are taken from their first scrape (what came before is not this session's)
    run.tentative = False
    run.metadata = {"kind": KIND_SERVING, "backend": s.engine,
                    "model": ",".join(sorted(m.model or s.engine for m in s.models))}
    run.serving = ServingState(s.key, s.url, s.engine, s.pid)
    run.notes.append(f"serving session: {s.engine} server {s.url}, process {s.pid}; J/token is J per output token")
    ledger._active[run_id] = run
    ledger._runs_log.info("started", "serving session %s started: %s at %s (pid %d)", run_id, s.engine, s.url, s.pid)
    ledger._holders_changed(run, start)
    return run


def _hour(t: float) -> str:
    return str(int(math.floor(t / HOUR) * HOUR))


def _bucket(state: ServingState, t: float) -> list[float]:
    return state.hours.setdefault(_hour(t), [0.0] * 6)


def _take_scrape(run: Run, s: ServingSession, on_frame: Any) -> None:
    """The session's latest scrape into the run: output tokens as the run's token series, per model."""
    state: ServingState = run.serving
    if s.last_scrape <= state.last_scrape:
        return
    state.last_scrape = s.last_scrape
    t = on_frame(s.last_scrape)
    for m in s.models:
        labels = {"model": m.model}
        key = (runs.TOKENS, (("model", m.model),))
        before = run.series[key].last_v - run.series[key].baseline if key in run.series else 0.0
        if key not in run.series and m.appeared_after is not None:
            points.apply_point(run, runs.TOKENS, labels, 0.0, min(t, on_frame(m.appeared_after)), None, t)
        points.apply_point(run, runs.TOKENS, labels, m.output_tokens, t, None, t)
        seen = state.models.get(m.model)
        if seen is None:
            base = (0.0, 0.0) if m.appeared_after is not None else (m.prompt_tokens, m.requests)
            seen = state.models[m.model] = [base[0], base[1], base[0], base[1]]
        bucket = _bucket(state, max(t - 1e-6, run.s))
        s_ = run.series[key]
        bucket[_OUTPUT] += (s_.last_v - s_.baseline) - before
        bucket[_PROMPT] += m.prompt_tokens - seen[2]
        bucket[_REQ] += m.requests - seen[3]
        seen[2], seen[3] = m.prompt_tokens, m.requests


def _count_energy(run: Run) -> None:
    """The energy counted since the last call into the hour it was counted in (the run's accumulator as of the
    previous snapshot: this runs before the ledger advances it)."""
    state: ServingState = run.serving
    acc = run.acc
    now = (acc.energy_j, acc.idle_j, acc.co2_g)
    if acc.t <= run.s:
        return
    bucket = _bucket(state, max(acc.t - 1e-6, run.s))
    for i, (value, counted) in enumerate(zip(now, state.counted, strict=True)):
        bucket[_ENERGY + i] += value - counted
    state.counted = list(now)


def _take_gpus(ledger: Any, run: Run, s: ServingSession, frame: Frame) -> None:
    """The session's processes are the run's; its GPUs those NVML lists them on."""
    for pid in s.pids:
        run.procs.setdefault(("", pid, "", ""), ["0", frame.t, frame.t])[2] = frame.t
    run.ranks.add("0")
    new = False
    for key, g in frame.gpus.items():
        if key not in run.gpus and g.procs is not None and any(p.pid in s.pids for p in g.procs):
            run.gpus[key] = g.uuid
            new = True
    if new:
        ledger._holders_changed(run, max(run.s, frame.t))


# ----------------------------------------------------------------------------------------------------
# the figures (the ledger's views)


def figures(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with the run's kind, and a serving run's own figures: no warm-up (a server's first requests
    are its work), prompt tokens, requests and J per 1,000 tokens (prompt + output)."""
    state: ServingState | None = getattr(run, "serving", None)
    if state is None:
        summary["kind"] = KIND_TRAINING
        return summary
    prompt = sum(m[2] - m[0] for m in state.models.values())
    requests = sum(m[3] - m[1] for m in state.models.values())
    output = summary.get("tokens")
    duration = summary.get("duration_s") or 0.0
    energy = summary.get("energy_j")
    summary.update(
        kind=KIND_SERVING, warmup_s=0.0, window_s=duration, prompt_tokens=prompt, requests=requests,
        tokens_per_s=output / duration if output is not None and duration > 0 else None,
        j_per_1k_tokens=(1000 * energy / (prompt + (output or 0.0))
                         if energy is not None and prompt + (output or 0.0) > 0 else None))
    return summary


def document(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    """What a serving run's document (``/api/v1/run``, the JSON summary) adds: its server, per model and per
    hour figures. Empty for a training run."""
    state: ServingState | None = getattr(run, "serving", None)
    if state is None:
        return {}
    energy = summary.get("energy_j") or 0.0
    hours = {k: list(v) for k, v in sorted(state.hours.items(), key=lambda kv: float(kv[0]))}
    if hours:  # square the hours with the totals (a recount, a settlement or the cut at the end)
        last = hours[max(hours, key=float)]
        last[_ENERGY] += energy - sum(h[_ENERGY] for h in hours.values())
        last[_IDLE] += (summary.get("idle_energy_j") or 0.0) - sum(h[_IDLE] for h in hours.values())
        last[_CO2] += (summary.get("co2_g") or 0.0) - sum(h[_CO2] for h in hours.values())
        last[_OUTPUT] += (summary.get("tokens") or 0.0) - sum(h[_OUTPUT] for h in hours.values())
    output_by_model: dict[str, float] = {}
    for (name, key), series in run.series.items():
        if name == runs.TOKENS:
            model = dict(key).get("model", "")
            output_by_model[model] = output_by_model.get(model, 0.0) + series.last_v - series.baseline
    total_out = sum(output_by_model.values())
    models = []
    for name, m in sorted(state.models.items()):
        out = output_by_model.get(name, 0.0)
        share = out / total_out if total_out > 0 else 1.0 / len(state.models)
        models.append({"model": name, "prompt_tokens": m[2] - m[0], "output_tokens": out,
                       "requests": m[3] - m[1], "energy_j": energy * share,
                       "j_per_output_token": energy * share / out if out > 0 else None})
    return {"serving": {
        "engine": state.engine, "url": state.url, "pid": state.pid, "models": models,
        "hours": [{"hour": iso_utc(float(k)), "prompt_tokens": h[_PROMPT], "output_tokens": h[_OUTPUT],
                   "requests": h[_REQ], "energy_j": h[_ENERGY], "idle_energy_j": h[_IDLE], "co2_g": h[_CO2],
                   "j_per_output_token": h[_ENERGY] / h[_OUTPUT] if h[_OUTPUT] > 0 else None}
                  for k, h in hours.items()],
    }}


__all__ = ["KIND_SERVING", "KIND_TRAINING", "ServingState", "document", "figures", "run_id_of", "track"]
