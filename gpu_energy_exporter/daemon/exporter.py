"""The exporter process: wires configuration to collectors, the sampler, the HTTP servers, the OTLP
receiver and the run ledger.

Construction validates everything that can be validated (web config, carbon region, bearer token file)
and raises ``ConfigError`` before anything starts; ``start()`` binds the ports and starts the threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector

from gpu_energy_exporter.collectors import registry
from gpu_energy_exporter.collectors.carbon import CarbonCollector, IntensityFileCollector, IntensityWatch
from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.collectors.registry import Wiring
from gpu_energy_exporter.core.clientid import Peer
from gpu_energy_exporter.core.contract import RUN_FINISHED
from gpu_energy_exporter.core.errors import ConfigError, ExporterError
from gpu_energy_exporter.core.state import GPUIdentity
from gpu_energy_exporter.daemon.api import api_routes, status_document
from gpu_energy_exporter.daemon.config import Config
from gpu_energy_exporter.daemon.endpoints import exporter_routes, inline_scrape
from gpu_energy_exporter.devices.base import GPUBackend
from gpu_energy_exporter.engine.exposition import (
    CachedExposition,
    CachedSource,
    PreparedSource,
    SnapshotCollector,
    new_registry,
)
from gpu_energy_exporter.engine.process import ProcessExposition
from gpu_energy_exporter.engine.sampler import Sampler
from gpu_energy_exporter.http.peers import PeerResolver
from gpu_energy_exporter.http.server import HTTPServer
from gpu_energy_exporter.http.splice import Splice
from gpu_energy_exporter.http.webconfig import load_web_config
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.journal import SteadyClock
from gpu_energy_exporter.otlp.census import RequestLimits
from gpu_energy_exporter.otlp.push import OTLPPusher, PushSettings, load_headers_file
from gpu_energy_exporter.otlp.receiver import ExportHandler, OTLPReceiver, load_bearer_tokens
from gpu_energy_exporter.otlp.store import TrainingStore
from gpu_energy_exporter.reference.carbon import resolve_intensity

if TYPE_CHECKING:
    from gpu_energy_exporter.otlp.grpcreceiver import GRPCReceiver

log = logging.getLogger(__name__)


class Exporter:
    """One exporter: ``Exporter(config).start()``, later ``stop()``."""

    def __init__(
        self,
        config: Config,
        *,
        backend_factory: Callable[[], GPUBackend] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self._started = False
        # Resolved even with --no-collector.carbon: the ledger's CO2 figures need it, and a bad region
        # must fail at start-up either way.
        self.intensity = resolve_intensity(config)
        # One watch of the intensity in force, read by the carbon collector and the ledger alike; with
        # the collector off, a collector of its own follows an intensity file (the ledger must not keep
        # the start-up intensity for ever).
        self.intensity_watch = IntensityWatch(self.intensity, config.carbon_intensity_file)
        # Every enabled collector, built by its own module's factory (collectors.registry), in order.
        wiring = Wiring(config, clock, self.read_counters_now, backend_factory=backend_factory,
                        intensity=self.intensity, intensity_watch=self.intensity_watch)
        collectors = registry.build(wiring)
        built = wiring.built
        gpu, carbon = built.get("gpu"), built.get("carbon")
        self.gpu = gpu if isinstance(gpu, GPUCollector) else None
        self.carbon = carbon if isinstance(carbon, CarbonCollector) else None
        self.health = built.get("health")
        self.kubernetes: Any = built.get("kubernetes")
        self.slurm: Any = built.get("slurm")
        self.services = wiring.services
        if self.carbon is None and self.intensity_watch.file is not None:
            collectors.append(IntensityFileCollector(self.intensity_watch))
        self.collectors = collectors
        self.sampler = Sampler(collectors, config.collector_interval, gpu_states=self.gpu.states if self.gpu else None,
                               clock=clock, **wiring.sampler_hooks)
        self.snapshot_collector = SnapshotCollector(self.sampler, clock=clock)
        self.registry = new_registry(self.snapshot_collector)
        self.process_collector = ProcessCollector(namespace="gpuenergy", registry=self.registry)
        self.process_exposition = ProcessExposition("gpuenergy")  # the same series, encoded directly
        self._build_servers()

    def read_counters_now(self) -> None:
        """A member's edge (a run's first point or its finish, a Slurm job's prolog or epilog): every GPU's
        energy counter is read in a sample taken now, so the settled figure covers exactly the member's own
        interval (issue 28). Any thread."""
        if self.gpu is not None:
            self.gpu.request_counter_read()
            self.sampler.sample_soon()

    def _identities(self) -> tuple[GPUIdentity, ...]:
        return self.gpu.identities() if self.gpu else ()

    def _build_servers(self) -> None:
        config = self.config
        self.web_config = load_web_config(config.web_config_file)
        self.store = TrainingStore(
            series_ttl=config.otlp_series_ttl,
            max_series=config.otlp_max_series,
            max_series_per_run=config.otlp_max_series_per_run,
            max_bytes=config.otlp_max_bytes,
            max_series_bytes=config.otlp_max_series_bytes,
            max_label_length=config.otlp_max_label_length,
            max_labels_per_point=config.otlp_max_labels_per_point,
            max_buckets_per_point=config.otlp_max_buckets_per_point,
            max_quantiles_per_point=config.otlp_max_quantiles_per_point,
            max_future_skew=config.otlp_max_future_skew,
            max_new_runs_per_request=config.otlp_max_new_runs_per_request,
            max_new_series_per_request=config.otlp_max_new_series_per_request,
            evict_idle_after=config.otlp_evict_idle_after,
            max_series_per_client=config.otlp_max_series_per_client,
            max_bytes_per_client=config.otlp_max_bytes_per_client,
        )
        self.snapshot_collector.add_live_source(self.store.collect)
        # The ledger runs on the steady clock (a wall-clock step moves no figure); the wall clock only
        # stamps the snapshots it receives, which it moves onto its own axis.
        steady = SteadyClock.start() if self._clock is time.time else self._clock
        self.ledger = RunLedger(
            config.runs_csv, warmup_s=config.runs_warmup, stale_after_s=config.runs_stale_after,
            carbon=self.carbon_for_ledger, clock=steady, wall=self._clock if steady is not self._clock else None,
            state_dir=runs_state_dir(config), db_path=config.runs_db, background_writes=True,
            journal_interval_s=config.runs_journal_interval, claim_grace_s=config.runs_claim_grace,
            max_active_per_client=config.runs_max_active_per_client, max_backdate_s=config.runs_max_backdate,
            new_runs_per_client_per_minute=config.runs_max_new_per_client,
            finished_runs_per_client_per_minute=config.runs_max_finished_per_client,
        )
        problem = self.ledger.check_writable()
        if problem:
            log.error("run ledger: %s", problem)
        self.sampler.add_listener(self.ledger.on_snapshot)
        # The ledger's series are encoded on the sampler thread after a snapshot when a scrape is expected
        # before the next one (engine.exposition.PreparedSource): a scrape serves them ready (pushes since
        # then show at the next snapshot; docs/ledger.md).
        self.ledger_exposition = PreparedSource(self.ledger.collect, self.ledger.version, clock=time.monotonic)
        self.sampler.add_listener(self.ledger_exposition.prepare)
        self.store.add_batch_listener(self.ledger.on_points)
        # who may change which run is decided before a point is stored: refused points are never exposed
        self.store.set_gate(self.ledger.admit)
        if self.gpu is not None:
            self.store.add_batch_listener(counter_reads_at_run_edges(self.read_counters_now))
        self.snapshot_collector.add_live_source(self.ledger.collect)
        sc = self.snapshot_collector
        self.exposition = CachedExposition([
            CachedSource(sc.static_families, version=lambda: 0),
            CachedSource(sc.snapshot_families, version=sc.snapshot_version),
            CachedSource(sc.age_families, encoder=sc.age_render),
            CachedSource(self.process_collector.collect, encoder=self.process_exposition.render),
            CachedSource(self.store.collect, version=self._store_version, encoder=self.store.render),
            CachedSource(self.ledger.collect, encoder=self.ledger_exposition.render),
            CachedSource(self._http_families, version=self._http_version),
        ])
        tokens = load_bearer_tokens(config.otlp_bearer_token_file) if config.otlp_bearer_token_file else None
        pods = None
        if self.kubernetes is not None and config.kubernetes_pod_identity:  # urllib and ssl (a few MB) only then
            from gpu_energy_exporter.collectors.kubernetes.podips import directory_from_config

            pods = directory_from_config(config, os.environ)
        # One handler for every OTLP transport: the store, the limits, the tokens and who a peer is
        # (the kernel's view through --path.procfs: docs/security.md)
        handler = ExportHandler(self.store, max_body_bytes=config.otlp_max_body_bytes, tokens=tokens,
                                resolver=PeerResolver(config.path_procfs), forwarders=config.otlp_trusted_forwarders,
                                request_limits=RequestLimits(config.otlp_max_points_per_request),
                                # a pod's address is that pod, its points only for its GPUs (--kubernetes.pod-identity)
                                pods=pods.pod_of if pods is not None else None,
                                pod_devices=self.kubernetes.devices_of if self.kubernetes is not None else None)
        self.otlp = OTLPReceiver(
            config.otlp_listen_address, self.store, handler=handler,
            max_connections=config.web_max_connections, request_timeout=config.web_request_timeout,
        )
        # The OTLP Unix socket: HTTP, and gRPC's HTTP/2 spliced to the gRPC port (http.splice; not when that
        # port serves TLS: the socket is plain text), each connection identified by SO_PEERCRED
        self.otlp_unix: OTLPReceiver | None = None
        self.spliced: dict[tuple[str, int], Peer] = {}
        if config.otlp_unix_socket:
            unix: list[OTLPReceiver] = []
            splice = Splice(self._grpc_target, lambda info: unix[0].unix_peer(info), self.spliced,
                            max_pairs=config.web_max_connections) \
                if config.otlp_grpc_listen_address is not None and self.web_config.tls is None else None
            self.otlp_unix = OTLPReceiver(
                config.otlp_listen_address, self.store, handler=handler, unix_path=config.otlp_unix_socket,
                max_connections=config.web_max_connections, request_timeout=config.web_request_timeout,
                splice=splice,
            )
            unix.append(self.otlp_unix)
        # OTLP/gRPC: the same handler (store, limits, token), TLS from the web config; grpc loads at bind()
        self.otlp_grpc: GRPCReceiver | None = None
        if config.otlp_grpc_listen_address is not None:
            # imported only when on: it brings asyncio (and with it ssl, about 9 MB together)
            from gpu_energy_exporter.otlp.grpcreceiver import GRPCReceiver

            self.otlp_grpc = GRPCReceiver(
                config.otlp_grpc_listen_address, self.otlp.handler, tls=self.web_config.tls,
                max_connections=config.web_max_connections, request_timeout=config.web_request_timeout,
                spliced=self.spliced,
            )
            self.exposition.sources.append(CachedSource(self.otlp_grpc.collect, version=self.otlp_grpc.version))
            self.snapshot_collector.add_live_source(self.otlp_grpc.collect)
        self.routes = exporter_routes(
            self.registry, telemetry_path=config.web_telemetry_path, ready=self.ready,
            links=[("OTLP receiver: POST /v1/metrics on " + _fmt(config.otlp_listen_address), "#")]
            + ([("OTLP/gRPC receiver: MetricsService/Export on " + _fmt(config.otlp_grpc_listen_address), "#")]
               if config.otlp_grpc_listen_address is not None else []),
            render=self.exposition.render,
        )
        self.routes.update(api_routes(self.status, self.ledger.runs, self.ledger.run))
        self.web: HTTPServer | None = None
        self.pusher: OTLPPusher | None = None
        if config.otlp_push_endpoint:
            headers = load_headers_file(config.otlp_push_headers_file) if config.otlp_push_headers_file else {}
            self.pusher = OTLPPusher(PushSettings(
                config.otlp_push_endpoint, interval_s=config.otlp_push_interval, headers=headers,
                ca_file=config.otlp_push_ca_file, cert_file=config.otlp_push_cert_file,
                key_file=config.otlp_push_key_file, insecure_skip_verify=config.otlp_push_insecure_skip_verify,
                timeout_s=min(10.0, config.otlp_push_interval),
            ), lambda: self.sampler.snapshot)
            self.exposition.sources.append(CachedSource(self.pusher.collect, version=self.pusher.version))
            self.snapshot_collector.add_live_source(self.pusher.collect)

    def carbon_now(self) -> tuple[float, float]:
        """(grid intensity g/kWh, PUE) in force now, whether or not the carbon collector runs."""
        return self.intensity_watch.value, self.config.carbon_pue

    def carbon_for_ledger(self) -> tuple[float, float, tuple[float, float] | None]:
        """``carbon_now`` and, when the intensity changed (its file was rewritten), (when, in wall-clock
        seconds, the value before): the ledger prices the interval that straddles the change part at each."""
        w = self.intensity_watch
        change = (w.since, w.previous) if w.since is not None and w.previous is not None else None
        return w.value, self.config.carbon_pue, change

    def status(self) -> dict[str, Any]:
        backend = self.gpu.backend if self.gpu else None
        return status_document(
            self.sampler,
            nvml_reason=lambda: self.gpu.unavailable_reason if self.gpu else "collector_disabled",
            carbon=self.carbon_now, carbon_source=self.intensity.source,
            backend_kind=lambda: backend.kind if backend else "", clock=self._clock,
        )

    def _grpc_target(self) -> tuple[str, int] | None:
        """Where the OTLP Unix socket's gRPC connections are spliced to: the gRPC port, over loopback."""
        grpc = self.otlp_grpc
        if grpc is None or not grpc.port:
            return None
        host = grpc.address[0].strip().strip("[]")
        if host in ("", "0.0.0.0", "localhost"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return host, grpc.port

    def _http_servers(self) -> list[HTTPServer]:
        unix = self.otlp_unix.http_server if self.otlp_unix is not None else None
        return [s for s in (self.web, self.otlp.http_server, unix) if s is not None]

    def _http_version(self) -> object:
        """The values ``_http_families`` serves, as they are (the bytes are encoded again when one moves)."""
        return tuple((s.name, tuple(s.stats.values()), s.open_connections()) for s in self._http_servers())

    def _http_families(self) -> list[Metric]:
        """Both ports' HTTP self-metrics, one family each (series labelled by server)."""
        servers = self._http_servers()
        if not servers:
            return []
        families = [s.collect() for s in servers]
        merged = families[0]
        for other in families[1:]:
            for fam, more in zip(merged, other, strict=True):
                fam.samples.extend(more.samples)
        return merged

    def _store_version(self) -> int:
        # Time-driven expiry bumps the version; the store sweeps at most once a second (O(series)), so a
        # series is served at most a second past its TTL.
        self.store.sweep()
        return self.store.version

    # ------------------------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        if self.sampler.snapshot is None:
            return False, "no sample taken yet"
        waiting = self.sampler.waiting_for()
        if waiting:
            return False, "waiting for the first update of collector(s) " + ", ".join(waiting)
        return True, "ready"

    def start(self) -> None:
        """Bind both ports, take the first sample, then serve. Raises ConfigError naming the flag when a port
        cannot be bound; nothing is announced (no "listening on" line) before both ports are bound."""
        try:
            web = HTTPServer(self.config.web_listen_address, self.routes, web_config=self.web_config,
                             name="gpu-energy-exporter", max_connections=self.config.web_max_connections,
                             request_timeout=self.config.web_request_timeout,
                             inline=inline_scrape(self.config.web_telemetry_path))
        except ConfigError as exc:
            raise ConfigError(_bind_message("web.listen-address", exc)) from None
        try:
            self.otlp.bind()
        except ConfigError as exc:
            web.shutdown()
            raise ConfigError(_bind_message("otlp.listen-address", exc)) from None
        if self.otlp_grpc is not None:
            try:
                self.otlp_grpc.bind()
            except ConfigError as exc:
                web.shutdown()
                self.otlp.shutdown()
                raise ConfigError(_bind_message("otlp.grpc.listen-address", exc)) from None
        if self.otlp_unix is not None:
            try:
                self.otlp_unix.bind()
            except ConfigError as exc:
                web.shutdown()
                self.otlp.shutdown()
                if self.otlp_grpc is not None:
                    self.otlp_grpc.shutdown()
                raise ConfigError(_bind_message("otlp.unix-socket", exc)) from None
        self.web = web
        self._started = True
        self.sampler.start()
        for service in self.services:
            service.start()
        if self.otlp_grpc is not None:
            self.otlp_grpc.start()
        self.web.start()
        self.otlp.start()
        if self.otlp_unix is not None:
            self.otlp_unix.start()
        if self.pusher is not None:
            self.pusher.start()
            log.info("pushing readings every %gs to %s", self.config.otlp_push_interval, self.config.otlp_push_endpoint)

    def stop(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.web is not None:
            self.web.shutdown()
        if self._started:
            self.otlp.shutdown()
            if self.otlp_unix is not None:
                self.otlp_unix.shutdown()
        if self.otlp_grpc is not None:
            self.otlp_grpc.shutdown()
        for service in self.services:
            service.stop()
        self.sampler.stop()
        self.ledger.close()


def runs_state_dir(config: Config) -> str | None:
    """Where the ledger's state (its database) lives: ``--runs.state-dir``, else ``.runs-state`` beside
    ``--runs.csv``; None without either (runs in memory only, unless ``--runs.db`` names the database)."""
    if config.runs_state_dir:
        return config.runs_state_dir
    if config.runs_csv:
        return os.path.join(os.path.dirname(os.path.abspath(config.runs_csv)), ".runs-state")
    return None


def _bind_message(flag: str, exc: ConfigError) -> str:
    text = str(exc)
    if "another process is using this port" in text:
        text = text.replace("choose another listen address", f"is an exporter or a demo already running? stop it "
                                                               f"or choose a free port with --{flag}")
        return f"--{flag}: {text}"
    return f"--{flag}: {text} (change --{flag})"


def _fmt(address: tuple[str, int]) -> str:
    host, port = address[0], address[1]
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


__all__ = ["Exporter", "ExporterError"]


#: Run ids remembered by ``counter_reads_at_run_edges`` (emptied at this size: a forgotten run asks once more).
RUN_EDGE_IDS = 4096


def counter_reads_at_run_edges(request: Callable[[], None]) -> Callable[[Sequence[Any]], None]:
    """A store batch listener: a request carrying a run's first point, or its ``training_run_finished`` of 1,
    calls ``request`` (``Exporter.read_counters_now``: every energy counter is read in a sample taken at
    once), so a run's energy between its edges is the counter's own delta, not power apportioned between
    reads every --collector.energy-interval. One set lookup per point; runs on the request thread."""
    seen: set[str] = set()
    finished = RUN_FINISHED.prometheus

    def listener(points: Sequence[Any]) -> None:
        edge = False
        for p in points:
            if p.run_id not in seen:
                if len(seen) >= RUN_EDGE_IDS:
                    seen.clear()
                seen.add(p.run_id)
                edge = True
            elif p.name == finished and p.value >= 1:
                edge = True
        if edge:
            request()

    return listener
