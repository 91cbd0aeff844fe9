"""The ``inference`` collector (off by default): local inference servers' token counters, scraped from their
own /metrics, so that the run ledger keeps serving sessions (J per output token per model, without Prometheus).

Targets are the URLs of ``--collector.inference.url`` and, with ``--collector.inference.discover``, every
local TCP port listened on by a process NVML lists on a GPU or by one of its ancestors (vLLM's API server
listens; its engine core and workers hold the GPUs), on which ``/metrics`` shows an engine's names. The
serving process is the port's listener (``procnet``: ``/proc/net/tcp``, ``/proc/<pid>/fd``); its GPUs are
those NVML lists it or its descendants on (the ledger's ``serving`` reads them from each snapshot).

A session is one server process's lifetime: it starts at the first scrape (or at the process's start, when
it started while the exporter watched), and ends when the server is gone (no good scrape for
``FORGET_SCRAPES`` cadences) or its counters go down (a restart: the next session starts at the scrape
before). Scrapes run on this collector's own thread (a pool of ``WORKERS``) every
``--collector.inference.interval``, each bounded in time and bytes (``scrape``) and in series and label sizes
(``engines``); ``update`` (the sampler thread) and ``sessions`` (the sampler's hook) only read what the last
scrapes left: a slow, hung or hostile server never holds up a sample or /metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.collectors.inference import procnet
from gpu_energy_exporter.collectors.inference.engines import ENGINES, OUTPUT, PROMPT, REQUESTS, Refused, parse
from gpu_energy_exporter.collectors.inference.scrape import check_url, fetch, port_of
from gpu_energy_exporter.collectors.registry import CollectorSpec, Wiring, register
from gpu_energy_exporter.core.flagtypes import Flag, parse_bool, parse_duration
from gpu_energy_exporter.core.metrics import add, define
from gpu_energy_exporter.core.ratelog import RateLimitedLog
from gpu_energy_exporter.core.state import GPUState, ServedModel, ServingSession

log = logging.getLogger(__name__)

NAME = "inference"
#: bounds of one answer (the OTLP receiver's kind: bytes, series, label sizes)
MAX_BYTES = 8 << 20
MAX_SERIES = 20_000
MAX_LABEL_BYTES = 2048
MAX_TARGETS = 16  # servers scraped at once (configured + discovered)
WORKERS = 4
FORGET_SCRAPES = 4  # a server with no good scrape for this many cadences is gone: its session ends
STOP_WAIT_S = 2.0  # how long stop waits for the threads (a scrape in flight) before leaving them to end
REPROBE_S = 600.0  # a discovered port that showed no engine is tried again after this
RESULTS = ("ok", "timeout", "unreachable", "http_error", "too_large", "too_many_series", "label_too_long",
           "malformed", "unrecognised")

SERVERS = define("inference", "servers", "gauge",
                 "Local inference servers whose token counters the exporter scrapes now (--collector.inference), by "
                 "engine: each is a serving session in the run ledger.", ["engine"], collector=NAME)
SCRAPES = define("inference", "scrapes_total", "counter",
                 "Scrapes of local inference servers' /metrics, by result: ok, or why the answer was not used "
                 "(timeout, unreachable, http_error, too_large, too_many_series, label_too_long, malformed, "
                 "unrecognised).", ["result"], collector=NAME)
RESETS = define("inference", "counter_resets_total", "counter",
                "Token counters of a local inference server that went down (the server restarted): each starts a "
                "new serving session.", [], collector=NAME)


@dataclass
class _Target:
    url: str
    configured: bool
    pid: int = 0
    ticks: int | None = None  # the listener's start ticks: a new process on the same port is a new session
    pids: tuple[int, ...] = ()
    engine: str = ""
    epoch: int = 0
    start: float = 0.0
    last_ok: float | None = None
    models: dict[str, ServedModel] = field(default_factory=dict)
    problem: str = ""


class InferenceCollector(Collector):
    name = NAME

    def __init__(self, urls: Sequence[str], *, discover: bool, interval_s: float = 15.0, timeout_s: float = 5.0,
                 procfs: str = "/proc", gpu_states: Callable[[], tuple[GPUState, ...]] | None = None,
                 wall: Callable[[], float] = time.time, max_bytes: int = MAX_BYTES, max_series: int = MAX_SERIES,
                 max_label_bytes: int = MAX_LABEL_BYTES) -> None:
        self._targets = {u: _Target(u, True) for u in urls}
        self._discover = discover
        self.interval_s, self.timeout_s = interval_s, min(timeout_s, interval_s)
        self._procfs, self._gpu_states, self._wall = procfs, gpu_states, wall
        self._bounds = (max_bytes, max_series, max_label_bytes)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(RESULTS, 0.0)
        self._resets = 0.0
        self._not_servers: dict[str, float] = {}  # discovered URL -> when it showed no engine
        self._started = time.time()  # the real clock, as /proc's process start times
        self._log = RateLimitedLog(log, burst=1, period_s=600.0)
        from concurrent.futures import ThreadPoolExecutor  # only when on: the registry imports this module always

        self._workers: list[threading.Thread] = []  # the pool's threads, for a bounded join at stop
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="inference-scrape",
                                        initializer=lambda: self._workers.append(threading.current_thread()))
        self._busy: set[str] = set()  # URLs whose scrape is still running (a hung server: one worker, not more)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the thread (a Service: the daemon starts and stops it) ------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="inference", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scraping and end the threads: the loop, then the pool's workers, waiting at most ``STOP_WAIT_S``
        in all (a scrape of a hung server still running ends at its own timeout, on its own)."""
        deadline = time.monotonic() + STOP_WAIT_S
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for worker in list(self._workers):
            worker.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrape_all()
            except Exception:  # noqa: BLE001 - the loop must go on; the log says what broke
                log.exception("inference collector: a round of scrapes failed")
            self._stop.wait(self.interval_s)

    def scrape_all(self, wait: bool = False) -> None:
        """Start one scrape of every target not still busy (``wait``: and wait for them, bounded by the
        timeout: the tests' synchronous form)."""
        if self._discover:
            self._find_servers()
        with self._lock:
            todo = [t for u, t in self._targets.items() if u not in self._busy]
            self._busy.update(t.url for t in todo)
        futures = [self._pool.submit(self._scrape, t) for t in todo]
        if wait:
            for f in futures:
                f.result(self.timeout_s + 5.0)

    # -- one target ------------------------------------------------------------------------------------

    def _scrape(self, target: _Target) -> None:
        try:
            max_bytes, max_series, max_label = self._bounds
            try:
                reading = parse(fetch(target.url, timeout_s=self.timeout_s, max_bytes=max_bytes),
                                max_series=max_series, max_label_bytes=max_label)
                if not reading.engine:
                    raise Refused("unrecognised", "no vLLM, SGLang, TGI or Triton token series")
            except Refused as exc:
                self._failed(target, exc)
                return
            now = self._wall()
            pid = procnet.listener(self._procfs, port_of(target.url), self._gpu_pids())
            with self._lock:
                self._counts["ok"] += 1
                self._update(target, reading.engine, reading.models, pid, now)
        finally:
            with self._lock:
                self._busy.discard(target.url)

    def _failed(self, target: _Target, exc: Refused) -> None:
        with self._lock:
            self._counts[exc.reason] = self._counts.get(exc.reason, 0.0) + 1
            if not target.configured and target.last_ok is None:
                self._not_servers[target.url] = self._wall()
                self._targets.pop(target.url, None)
                return
            problem = f"{exc.reason}: {exc}"
        if problem != target.problem:
            target.problem = problem
            self._log.warning(("scrape", target.url), "inference server %s: %s (its tokens are not counted "
                              "until it answers)", target.url, exc)

    def _update(self, t: _Target, engine: str, models: dict[str, list[float]], pid: int | None, now: float) -> None:
        """Fold one good answer into the target's session (under the lock)."""
        t.problem = ""
        ticks = procnet.start_ticks(self._procfs, pid) if pid else None
        new_process = t.last_ok is None or pid != t.pid or ticks != t.ticks
        reset = not new_process and any(
            (m := t.models.get(name)) is not None and (c[PROMPT] < m.prompt_tokens or c[OUTPUT] < m.output_tokens
                                                       or c[REQUESTS] < m.requests) for name, c in models.items())
        prev_ok = t.last_ok
        if new_process:
            t.pid, t.ticks, t.epoch, t.engine = pid or 0, ticks, 0, engine
            started = procnet.started_at(self._procfs, pid) if pid else None
            if started is not None:
                started = now - max(0.0, time.time() - started)  # on ``wall``: the process's age ago
            # A process that started while we watched counted from 0 at its start; else from what we first see.
            fresh = (started is not None and now - started < time.time() - self._started
                     and (prev_ok is None or started > prev_ok))
            t.start = min(started, now) if fresh and started is not None else now
            since = t.start if fresh else None
            t.models = {}
            if not fresh:
                t.models = {n: ServedModel(n, c[PROMPT], c[OUTPUT], c[REQUESTS]) for n, c in models.items()}
            else:
                t.models = {n: ServedModel(n, c[PROMPT], c[OUTPUT], c[REQUESTS], since) for n, c in models.items()}
        elif reset:
            self._resets += 1
            t.epoch += 1
            t.start = prev_ok if prev_ok is not None else now
            t.models = {n: ServedModel(n, c[PROMPT], c[OUTPUT], c[REQUESTS], t.start) for n, c in models.items()}
            self._log.warning(("reset", t.url), "inference server %s: its token counters went down (a restart): "
                              "a new serving session from %s", t.url, time.strftime("%H:%M:%S", time.gmtime(t.start)))
        else:
            for n, c in models.items():
                old = t.models.get(n)
                after = old.appeared_after if old is not None else prev_ok
                t.models[n] = ServedModel(n, c[PROMPT], c[OUTPUT], c[REQUESTS], after)
        t.engine = engine
        t.pids = self._family(t.pid)
        t.last_ok = now

    # -- processes -------------------------------------------------------------------------------------

    def _gpu_pids(self) -> list[int]:
        if self._gpu_states is None:
            return []
        out: list[int] = []
        for g in self._gpu_states():
            procs = g.reading.processes if g.reading is not None else None
            out.extend(p.pid for p in procs or () if p.pid not in out)
        return out

    def _family(self, pid: int) -> tuple[int, ...]:
        """The listener and the GPU processes that descend from it."""
        if not pid:
            return ()
        out = [pid]
        for gpid in self._gpu_pids():
            if gpid != pid and pid in procnet.ancestors(self._procfs, gpid):
                out.append(gpid)
        return tuple(out)

    def _find_servers(self) -> None:
        """New targets: ports listened on by GPU processes or their ancestors (``--collector.inference.discover``)."""
        listening = procnet.listening(self._procfs)
        if not listening:
            return
        now = self._wall()
        seen: set[int] = set()
        for gpid in self._gpu_pids():
            for pid in procnet.ancestors(self._procfs, gpid):
                if pid in seen:
                    continue
                seen.add(pid)
                for inode in procnet.socket_inodes(self._procfs, pid) & set(listening):
                    addr, port = listening[inode]
                    host = _host(addr)
                    if host is None:
                        continue
                    url = f"http://{host}:{port}/metrics"
                    with self._lock:
                        if url in self._targets or now - self._not_servers.get(url, -REPROBE_S) < REPROBE_S:
                            continue
                        if len(self._targets) >= MAX_TARGETS:
                            return
                        self._targets[url] = _Target(url, False)

    # -- what the sampler reads --------------------------------------------------------------------------

    def sessions(self) -> tuple[ServingSession, ...]:
        """The serving sessions now (the sampler's hook, carried to the ledger on each snapshot)."""
        now = self._wall()
        out = []
        with self._lock:
            for t in self._targets.values():
                if t.last_ok is None or not t.models or not t.pid or now - t.last_ok > FORGET_SCRAPES * self.interval_s:
                    continue
                key = f"{port_of(t.url)}-{t.pid}" + (f".{t.epoch}" if t.epoch else "")
                out.append(ServingSession(key, t.url, t.engine, t.pid, t.pids, t.start, t.last_ok,
                                          tuple(t.models.values())))
        return tuple(out)

    def update(self) -> list[Metric]:
        sessions = self.sessions()
        servers = SERVERS.family()
        for engine in ENGINES:
            add(servers, [engine], float(sum(1 for s in sessions if s.engine == engine)))
        scrapes, resets = SCRAPES.family(), RESETS.family()
        with self._lock:
            for result in RESULTS:
                add(scrapes, [result], self._counts[result])
            add(resets, [], self._resets)
        return [servers, scrapes, resets]


def _host(addr: str) -> str | None:
    """A URL host for a listening socket's local address (``/proc/net/tcp*`` hex), or None (another host's)."""
    if len(addr) == 8:  # IPv4, little-endian on the hosts we run on
        if addr in ("00000000", "0100007F"):
            return "127.0.0.1"
        return None  # bound to one non-loopback address: not reachable as localhost
    if addr in ("0" * 32, "00000000000000000000000001000000"):
        return "[::1]"
    if addr.startswith("0000000000000000FFFF0000"):  # IPv4-mapped
        return _host(addr[24:])
    return None


def _urls(raw: str) -> tuple[str, ...]:
    return tuple(check_url(u) for u in raw.split(",") if u.strip())


def _build(w: Wiring) -> InferenceCollector:
    cfg: Any = w.config
    gpu: Any = w.built.get("gpu")
    urls = cfg.collector_inference_url
    if not urls and not cfg.collector_inference_discover:
        from gpu_energy_exporter.core.errors import ConfigError

        raise ConfigError("--collector.inference needs --collector.inference.url or --collector.inference.discover")
    collector = InferenceCollector(
        urls, discover=cfg.collector_inference_discover, interval_s=cfg.collector_inference_interval,
        timeout_s=cfg.collector_inference_timeout, procfs=cfg.path_procfs,
        gpu_states=gpu.states if gpu is not None else None,
        wall=w.clock)  # the sampler's clock: the ledger places each scrape against the snapshot's timestamp
    w.sampler_hooks["serving"] = collector.sessions  # serving sessions are runs (ledger.serving)
    w.services.append(collector)
    return collector


register(CollectorSpec(
    NAME, False, "Local inference servers' token counters (vLLM, SGLang, TGI, Triton), for serving sessions in the "
    "run ledger (docs/inference.md, Without Prometheus).", order=70, build=_build,
    title="Inference servers (collector `inference`)",
    flags=(
        Flag("collector.inference.url", _urls, "", "Comma-separated /metrics URLs of inference servers on this host "
             "(http://127.0.0.1:8000/metrics); the serving process is the one listening on the port.", "URLS"),
        Flag("collector.inference.discover", parse_bool, "false", "Also scrape /metrics on every local TCP port "
             "listened on by a process NVML lists on a GPU (or by its parent: vLLM's API server).", boolean=True),
        Flag("collector.inference.interval", parse_duration, "15s", "How often the servers' /metrics are scraped.",
             "DURATION"),
        Flag("collector.inference.timeout", parse_duration, "5s", "How long one scrape may take (at most the "
             "interval); a slower server's tokens wait for a later scrape.", "DURATION"),
    ),
))
