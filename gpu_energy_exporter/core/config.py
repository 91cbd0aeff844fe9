"""Configuration: flags, environment variables and their validation.

``load_config(argv, environ)`` is a pure function from the command line and an environment mapping to a
frozen ``Config``, or a ``ConfigError`` whose message names the flag, the environment variable and what
is accepted. Nothing starts before the whole configuration is valid.

Every flag ``--a.b-c`` can also be set by the environment variable ``GPU_ENERGY_EXPORTER_A_B_C``; a flag
on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.core.clientid import parse_forwarders
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.flagparser import FlagParser, did_you_mean
from gpu_energy_exporter.core.flagtypes import (  # noqa: F401 - parse_* and Flag are part of config's API
    ENV_PREFIX,
    CollectorFlag,
    Flag,
    _choice,
    _existing_dir,
    _existing_file,
    _non_negative_float,
    _positive_float,
    _positive_int,
    _text,
    _url,
    parse_bool,
    parse_duration,
    parse_listen_address,
    parse_optional_listen_address,
)
from gpu_energy_exporter.core.ports import (  # noqa: F401 - the default ports are part of config's API
    DEFAULT_METRICS_PORT,
    DEFAULT_OTLP_GRPC_PORT,
    DEFAULT_OTLP_PORT,
)

# ----------------------------------------------------------------------------------------------------
# the flag table


FLAGS: tuple[Flag, ...] = (
    Flag("web.listen-address", parse_listen_address, f":{DEFAULT_METRICS_PORT}",
         "Address for /metrics, the landing page and health endpoints.", "HOST:PORT"),
    Flag("web.telemetry-path", _text, "/metrics", "Path under which metrics are exposed.", "PATH"),
    Flag("web.config.file", _existing_file, None,
         "Web configuration file (Prometheus exporter-toolkit format) enabling TLS and/or basic auth.",
         "FILE"),
    Flag("web.max-connections", _positive_int, "256",
         "Most connections open at once on each port (metrics and OTLP). At the cap, a new connection "
         "closes the one idle, or sending its request, the longest.", "N"),
    Flag("web.request-timeout", parse_duration, "30s",
         "Time a client has to send a whole request, head and body, on either port (the head alone: "
         "10s at most). Past it the client gets 408 and the connection is closed.", "DURATION"),
    Flag("otlp.listen-address", parse_listen_address, f"localhost:{DEFAULT_OTLP_PORT}",
         "Address of the OTLP/HTTP receiver (POST /v1/metrics). Set to 0.0.0.0:4318 in deployments "
         "where trainers run in other containers.", "HOST:PORT"),
    Flag("otlp.max-body-bytes", _positive_int, str(8 * 1024 * 1024),
         "Largest accepted OTLP request body, checked before and after gzip decompression (OTLP/gRPC: the "
         "largest message, also after decompression).", "BYTES"),
    Flag("otlp.max-points-per-request", _positive_int, "16384",
         "Most data points in one OTLP request (HTTP or gRPC); a request with more is refused whole (413, gRPC "
         "INVALID_ARGUMENT) before it is decoded. Resources, scopes, metrics and what the decoding allocates are "
         "bounded in proportion (docs/security.md).", "N"),
    Flag("otlp.series-ttl", parse_duration, "10m",
         "Training series not updated for this long are dropped from /metrics.", "DURATION"),
    Flag("otlp.max-series", _positive_int, "20000",
         "Most training series kept in total; points for new series beyond it are rejected.", "N"),
    Flag("otlp.max-series-per-run", _positive_int, "2000",
         "Most training series kept per run id; points for new series beyond it are rejected.", "N"),
    Flag("otlp.max-bytes", _positive_int, str(64 * 1024 * 1024),
         "Most estimated memory held by training series in total; points for new series beyond it are "
         "rejected, and one request may add at most a quarter of it.", "BYTES"),
    Flag("otlp.max-series-bytes", _positive_int, str(256 * 1024),
         "Largest estimated size of one training series (labels times samples); bigger points are rejected.",
         "BYTES"),
    Flag("otlp.max-label-length", _positive_int, "2048",
         "Longest metric name, attribute name or attribute value (characters); longer points are rejected.",
         "N"),
    Flag("otlp.max-labels-per-point", _positive_int, "32",
         "Most attributes on one data point; points with more are rejected.", "N"),
    Flag("otlp.max-buckets-per-point", _positive_int, "256",
         "Most buckets in one histogram data point; points with more are rejected.", "N"),
    Flag("otlp.max-quantiles-per-point", _positive_int, "64",
         "Most quantiles in one summary data point; points with more are rejected.", "N"),
    Flag("otlp.max-future-skew", parse_duration, "24h",
         "Points (or stream start times) dated more than this after their request arrived are rejected "
         "(a point's time only orders its stream: a trainer's or the exporter's clock stepped by an hour "
         "loses nothing).",
         "DURATION"),
    Flag("otlp.max-new-runs-per-request", _positive_int, "16",
         "Most new run ids one request may start; their points beyond it are rejected (a flood of run ids "
         "cannot lock out other trainers).", "N"),
    Flag("otlp.max-new-series-per-request", _positive_int, "2000",
         "Most new training series one request may create; series that already exist always update.", "N"),
    Flag("otlp.evict-idle-after", parse_duration, "2m",
         "When the series or byte limit is reached, series not updated for this long are dropped to make "
         "room (before --otlp.series-ttl).", "DURATION"),
    Flag("otlp.bearer-token-file", _existing_file, None,
         "If set, OTLP pushes must carry 'Authorization: Bearer <token>' with a token from this file: the "
         "whole file is one token, or each line is '<tenant> <token>' (per-tenant tokens: a push's identity is "
         "then its token's tenant, whatever the network path; docs/security.md).",
         "FILE"),
    Flag("otlp.unix-socket", _text, None,
         "Also receive OTLP on this Unix-domain socket (OTLP/HTTP, and OTLP/gRPC when "
         "--otlp.grpc.listen-address is on), e.g. /run/gpu-energy-exporter/otlp.sock, the path the training "
         "helper uses when it exists. Mode 0666: any local user may connect; each connection is identified by "
         "the kernel (SO_PEERCRED), not by what it sends.", "PATH"),
    Flag("otlp.trusted-forwarders", parse_forwarders, "",
         "Comma-separated pushers trusted to vouch for their clients' host.name and process.pid (an "
         "OpenTelemetry Collector): uid=N (a local Collector's user), an address or network (10.0.0.7, "
         "10.1.0.0/16) or tenant=NAME (a per-tenant token). Other pushers' attributes are claims checked "
         "against their own identity (docs/security.md).", "LIST"),
    Flag("otlp.max-series-per-client", _positive_int, "5000",
         "Most training series one identity (a process as the kernel sees it, a tenant, an address) may hold; "
         "its points for new series beyond it are rejected, other identities' are not (the global "
         "--otlp.max-series stays the last bound).", "N"),
    Flag("otlp.max-bytes-per-client", _positive_int, str(16 * 1024 * 1024),
         "Most estimated memory one identity's training series may hold (within --otlp.max-bytes).", "BYTES"),
    Flag("otlp.grpc.listen-address", parse_optional_listen_address, f"localhost:{DEFAULT_OTLP_GRPC_PORT}",
         "Address of the OTLP/gRPC receiver (MetricsService/Export), sharing the OTLP/HTTP receiver's store, "
         "limits and bearer token; TLS from --web.config.file's tls_server_config. Empty turns it off. The port "
         "is bound at start; in plain text grpc is loaded when the first client connects (with TLS, at start).",
         "HOST:PORT"),
    Flag("otlp.push-endpoint", _url, None,
         "Also push this node's readings over OTLP/HTTP to this URL (e.g. http://collector:4318/v1/metrics), "
         "named after the OpenTelemetry hardware semantic conventions. Off when unset.", "URL"),
    Flag("otlp.push-interval", parse_duration, "10s", "How often readings are pushed to --otlp.push-endpoint.",
         "DURATION"),
    Flag("otlp.push-headers-file", _existing_file, None,
         "File of HTTP headers sent with every push, one 'Name: value' per line (e.g. an API key).", "FILE"),
    Flag("otlp.push-ca-file", _existing_file, None,
         "CA certificate(s) that verify an https:// --otlp.push-endpoint (default: the system's).", "FILE"),
    Flag("otlp.push-cert-file", _existing_file, None, "Client certificate for mutual TLS with the push endpoint.",
         "FILE"),
    Flag("otlp.push-key-file", _existing_file, None, "Private key of --otlp.push-cert-file.", "FILE"),
    Flag("otlp.push-insecure-skip-verify", parse_bool, "false",
         "Do not verify the push endpoint's TLS certificate (testing only).", "BOOL"),
    Flag("collector.interval", parse_duration, "1s",
         "How often GPUs and the host are sampled (the snapshot /metrics serves).", "DURATION"),
    Flag("collector.power-interval", parse_duration, "100ms",
         "Fast power sampling period used to integrate energy on GPUs without an energy counter "
         "(pre-Volta); 20ms at the lowest.", "DURATION", collector="gpu"),
    Flag("collector.energy-interval", parse_duration, "30s",
         "How often each GPU's energy counter is read (about 3.5 ms of CPU a read on an H100, driver 580; the "
         "other readings cost microseconds). Between two reads each sample's energy is apportioned by the "
         "GPU's ~1 s average power, and at each read the exposed energy meets the counter exactly; runs and "
         "pods keep --collector.interval's grid (docs/measurement.md). At most --collector.interval reads "
         "it every sample.", "DURATION", collector="gpu"),
    Flag("collector.gpm-interval", parse_duration, "30s",
         "How often GPM (SM, tensor, DRAM activity) is sampled: about 2 ms of CPU a sample on an H100 (1.8-2.0 "
         "ms of it computing the metrics). Each figure is the average over the span between two GPM samples, "
         "served until the next: a longer interval loses no activity, only time resolution.", "DURATION",
         collector="gpm"),
    Flag("collector.gpu.energy-timestamps", parse_bool, "false",
         "Expose the GPU energy counter with the time it was read as an explicit sample timestamp. Off by "
         "default, as Prometheus' guidelines for exporters ask; see docs/measurement.md for what it costs "
         "(staleness markers, clock steps) and Prometheus' track_timestamps_staleness.",
         boolean=True, collector="gpu"),
    Flag("collector.health.interval", parse_duration, "30s",
         "How often the health collector reads ECC, row remapping, retired pages, PCIe and NVLink (they change "
         "slowly; each read costs NVML calls per GPU, see docs/health.md). Xid and ECC events are counted as "
         "they happen, whatever this is.", "DURATION", collector="health"),
    Flag("nvml.library", _existing_file, None,
         "Path of libnvidia-ml.so.1 to load instead of the one the dynamic linker finds.", "PATH", collector="gpu"),
    Flag("path.sysfs", _existing_dir, "/sys", "sysfs mount point (RAPL powercap tree).", "PATH", collector="rapl"),
    Flag("path.procfs", _existing_dir, "/proc",
         "procfs mount point: host CPU and memory are read there (the exporter's own process_* series keep "
         "/proc/self).", "PATH"),
    Flag("carbon.intensity", _non_negative_float, None,
         "Grid carbon intensity in gCO2e/kWh. Overrides --carbon.region. Default: world average "
         "(see docs/measurement.md).", "G_PER_KWH"),
    Flag("carbon.region", _text, None,
         "Country (ISO 3166-1 alpha-3, e.g. FRA) or cloud region (e.g. gcp:europe-west1) "
         "whose carbon intensity to use from the bundled table.", "CODE"),
    Flag("carbon.intensity-file", _existing_file, None,
         "File holding the current carbon intensity in gCO2e/kWh (one number), re-read when it "
         "changes, for a time-varying grid.", "FILE"),
    Flag("carbon.pue", _positive_float, "1.0",
         "Power usage effectiveness of the data centre (facility energy / IT energy), >= 1.", "RATIO"),
    Flag("host.memory-critical", _positive_int, str(1 << 30),
         "Host available memory under which the exporter warns (log, alert, terminal view).", "BYTES",
         collector="host"),
    Flag("gpu.idle-power", _non_negative_float, None,
         "Idle power of each GPU in watts, used for dynamic energy. Default: learned from samples "
         "with no compute process.", "WATTS", collector="gpu"),
    Flag("runs.csv", _text, None,
         "Append one row per finished training run to this CSV file (a JSON summary per run is "
         "written beside it).", "FILE"),
    Flag("runs.warmup", parse_duration, "30s",
         "Start of each run excluded from its efficiency figures (J/token, tokens/s).", "DURATION"),
    Flag("runs.stale-after", parse_duration, "5m",
         "A run that pushed nothing for this long is finished as stale.", "DURATION"),
    Flag("runs.state-dir", _text, None,
         "Directory of the run ledger's database (runs.db): open runs and rows not yet written survive a "
         "restart or an upgrade (SIGTERM or SIGKILL) and continue as the same runs. Default: .runs-state "
         "beside --runs.csv; without either (or --runs.db), runs are kept in memory only. It must be owned "
         "by the exporter's user and writable by no one else, or it is refused (docs/ledger.md). Put it on a "
         "local disk.", "DIR"),
    Flag("runs.db", _text, None,
         "The run ledger's SQLite database: every finished run's row and the open runs' state, to query "
         "with sqlite3, pandas or `gpu-energy-exporter runs --db` (schema in docs/ledger.md); --runs.csv and "
         "the JSON summaries are exports of it. Default: runs.db in --runs.state-dir.", "FILE"),
    Flag("runs.journal-interval", parse_duration, "5s",
         "How often the open runs are checkpointed into the database (a run closing is written at "
         "once); what a SIGKILL can lose of a run's timeline, never of its energy or tokens.", "DURATION"),
    Flag("runs.max-backdate", parse_duration, "10s",
         "A run's first point dated longer than this before it arrived starts the run this long before its "
         "arrival (noted on the run): the history a new run replays, and every run sharing its GPUs "
         "recounts, stays bounded whatever a point's timestamp.", "DURATION"),
    Flag("runs.max-active-per-client", _positive_int, "64",
         "Most runs with training progress one identity (a process as the kernel sees it, a tenant, an "
         "address: docs/security.md) may have going at once in the "
         "ledger; its further new runs are refused (counted) until one ends.", "RUNS"),
    Flag("runs.max-new-per-client", _positive_int, "60",
         "Most runs one identity may start per minute in the ledger (a token bucket holding "
         "a minute's worth); its further new runs stay tentative, charged nothing and never written.",
         "RUNS_PER_MINUTE"),
    Flag("runs.max-finished-per-client", _positive_int, "60",
         "Most runs one identity may finish per minute (each finished run writes a CSV row and "
         "a JSON summary); a refused finish leaves the run going until a later push or --runs.stale-after.",
         "RUNS_PER_MINUTE"),
    Flag("kubernetes.pod-resources-socket", _text, "/var/lib/kubelet/pod-resources/kubelet.sock",
         "Kubelet pod-resources socket used to attribute GPUs to pods.", "PATH", collector="kubernetes"),
    Flag("kubernetes.refresh-interval", parse_duration, "10s",
         "How often the GPU to pod mapping is refreshed from the kubelet.", "DURATION", collector="kubernetes"),
    Flag("kubernetes.pod-identity", parse_bool, "true",
         "Know an OTLP push from a pod's address as that pod (this node's pods, listed from the API server; RBAC "
         "pods list), and refuse its points for GPUs the pod does not hold (docs/security.md).",
         boolean=True, collector="kubernetes"),
    Flag("kubernetes.api-url", _text, "", "Kubernetes API server for --kubernetes.pod-identity (default: "
         "in the pod, KUBERNETES_SERVICE_HOST/PORT, with the service account's token and CA).", "URL",
         collector="kubernetes"),
    Flag("kubernetes.node-name", _text, "", "This node's name, whose pods --kubernetes.pod-identity lists "
         "(default: $NODE_NAME, set from the downward API's spec.nodeName).", "NAME", collector="kubernetes"),
    Flag("collector.slurm.job-mapping-dir", _text, "/run/gpu-energy-exporter/slurm-jobs",
         "Directory the Slurm prolog/epilog keep (dcgm-exporter's DCGM_HPC_JOB_MAPPING_DIR format: one file "
         "per GPU index, or '<index>.<gpu instance>' for MIG, listing job ids) for --collector.slurm.",
         "DIR", collector="slurm"),
    Flag("collector.gpu.process-interval", parse_duration, "10s",
         "A GPU shared by several processes is asked for its per-process SM utilisation "
         "(nvmlDeviceGetProcessUtilization: 1.6-2.6 ms of CPU per call on an H100) with every read of its "
         "energy counter and this often between reads. The driver answers one mean per process since the "
         "last ask: the asks since a counter read split the span that read settles, piece by piece; between "
         "asks the last weights hold (provisional). A GPU with one process is never asked. 0 never asks "
         "(shared GPUs are split evenly).", "DURATION", collector="gpu"),
    Flag("runs.claim-grace", parse_duration, "30s",
         "How long after a run's start a GPU it names may go without NVML listing one of its processes "
         "(CUDA start-up); meanwhile it shares only energy no other run's process uses. After it, an "
         "unconfirmed GPU claim is charged nothing (docs/ledger.md).", "DURATION"),
    Flag("log.level", _choice("debug", "info", "warn", "error"), "info", "Log level.", "LEVEL"),
    Flag("log.format", _choice("logfmt", "json"), "logfmt", "Log format.", "FORMAT"),
)

COLLECTORS: tuple[CollectorFlag, ...] = (
    CollectorFlag("gpu", True, "Per-GPU power, energy, memory, utilisation, temperature, clocks (NVML)."),
    CollectorFlag("gpm", True, "GPM SM/tensor/DRAM activity on Hopper and newer (NVML GPM)."),
    CollectorFlag("processes", False, "Per-process GPU memory with pid labels (high cardinality)."),
    CollectorFlag("host", True, "Host CPU utilisation and memory (psutil)."),
    CollectorFlag("rapl", True, "CPU package/DRAM energy from the Linux powercap (RAPL) tree."),
    CollectorFlag("carbon", True, "Carbon intensity, PUE and per-GPU peak FLOP/s inputs for PromQL."),
    CollectorFlag("kubernetes", False, "GPU to pod attribution through the kubelet pod-resources API."),
    CollectorFlag("slurm", False, "GPU energy per Slurm job from the prolog's job-mapping directory."),
    CollectorFlag("health", True, "GPU health: Xid and ECC events, ECC counts, row remapping, retired pages, "
                  "PCIe and NVLink (NVML; see --collector.health.interval)."),
)


@dataclass(frozen=True)
class Config:
    web_listen_address: tuple[str, int] = ("", DEFAULT_METRICS_PORT)
    web_telemetry_path: str = "/metrics"
    web_config_file: str | None = None
    web_max_connections: int = 256
    web_request_timeout: float = 30.0
    otlp_listen_address: tuple[str, int] = ("localhost", DEFAULT_OTLP_PORT)
    otlp_max_body_bytes: int = 8 * 1024 * 1024
    otlp_max_points_per_request: int = 16384
    otlp_series_ttl: float = 600.0
    otlp_max_series: int = 20000
    otlp_max_series_per_run: int = 2000
    otlp_max_bytes: int = 64 * 1024 * 1024
    otlp_max_series_bytes: int = 256 * 1024
    otlp_max_label_length: int = 2048
    otlp_max_labels_per_point: int = 32
    otlp_max_buckets_per_point: int = 256
    otlp_max_quantiles_per_point: int = 64
    otlp_max_future_skew: float = 86400.0
    otlp_max_new_runs_per_request: int = 16
    otlp_max_new_series_per_request: int = 2000
    otlp_evict_idle_after: float = 120.0
    otlp_bearer_token_file: str | None = None
    otlp_unix_socket: str | None = None
    otlp_trusted_forwarders: tuple[str, ...] = ()
    otlp_max_series_per_client: int = 5000
    otlp_max_bytes_per_client: int = 16 * 1024 * 1024
    otlp_grpc_listen_address: tuple[str, int] | None = ("localhost", DEFAULT_OTLP_GRPC_PORT)
    otlp_push_endpoint: str | None = None
    otlp_push_interval: float = 10.0
    otlp_push_headers_file: str | None = None
    otlp_push_ca_file: str | None = None
    otlp_push_cert_file: str | None = None
    otlp_push_key_file: str | None = None
    otlp_push_insecure_skip_verify: bool = False
    collector_interval: float = 1.0
    collector_power_interval: float = 0.1
    collector_gpu_energy_timestamps: bool = False
    collector_health_interval: float = 30.0
    collector_energy_interval: float = 30.0
    collector_gpm_interval: float = 30.0
    nvml_library: str | None = None
    path_sysfs: str = "/sys"
    path_procfs: str = "/proc"
    carbon_intensity: float | None = None
    carbon_region: str | None = None
    carbon_intensity_file: str | None = None
    carbon_pue: float = 1.0
    host_memory_critical: int = 1 << 30
    gpu_idle_power: float | None = None
    runs_csv: str | None = None
    runs_warmup: float = 30.0
    runs_stale_after: float = 300.0
    runs_state_dir: str | None = None
    runs_db: str | None = None
    runs_journal_interval: float = 5.0
    collector_gpu_process_interval: float = 10.0
    runs_claim_grace: float = 30.0
    runs_max_backdate: float = 10.0
    runs_max_active_per_client: int = 64
    runs_max_new_per_client: int = 60
    runs_max_finished_per_client: int = 60
    kubernetes_pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    kubernetes_refresh_interval: float = 10.0
    kubernetes_pod_identity: bool = True
    kubernetes_api_url: str = ""
    kubernetes_node_name: str = ""
    collector_slurm_job_mapping_dir: str = "/run/gpu-energy-exporter/slurm-jobs"
    log_level: str = "info"
    log_format: str = "logfmt"
    collectors: frozenset[str] = field(
        default_factory=lambda: frozenset(c.name for c in COLLECTORS if c.default)
    )

    def enabled(self, collector: str) -> bool:
        return collector in self.collectors


class _Parser(FlagParser):
    """The exporter's parser: raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{did_you_mean(message, self.known_flags())} (see --help)")


def add_exporter_flags(parser: argparse.ArgumentParser) -> None:
    """Add every exporter flag to ``parser`` (also used by sub-commands that start an exporter)."""
    group = parser.add_argument_group("exporter flags (each also settable as GPU_ENERGY_EXPORTER_<FLAG>)")
    for flag in FLAGS:
        default = f" (default: {flag.default})" if flag.default is not None else ""
        if flag.boolean:
            group.add_argument(
                "--" + flag.name, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                help=f"{flag.help}{default} [env {flag.env}]",
            )
            continue
        group.add_argument(
            "--" + flag.name, dest=flag.dest, metavar=flag.metavar, default=None,
            help=f"{flag.help}{default} [env {flag.env}]",
        )
    cgroup = parser.add_argument_group("collectors (--collector.<name> enables, --no-collector.<name> disables)")
    for c in COLLECTORS:
        cgroup.add_argument(
            "--collector." + c.name, dest=c.dest, action=argparse.BooleanOptionalAction, default=None,
            help=f"{c.help} (default: {'enabled' if c.default else 'disabled'}) [env {c.env}]",
        )


def new_parser(prog: str = "gpu-energy-exporter") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Serve GPU energy and host metrics for Prometheus.")
    add_exporter_flags(parser)
    return parser


def config_from_namespace(ns: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    """Resolve parsed flags (``None`` when not given) against the environment and defaults."""
    values: dict[str, Any] = {}
    for flag in FLAGS:
        raw: str | bool | None = getattr(ns, flag.dest, None)
        if isinstance(raw, bool):  # a switch given on the command line
            values[flag.dest] = raw
            continue
        source = f"--{flag.name}"
        if raw is None and flag.env in environ:
            raw, source = environ[flag.env], f"environment variable {flag.env}"
        if raw is None:
            raw, source = flag.default, f"default of --{flag.name}"
        if raw is None:
            values[flag.dest] = None
            continue
        try:
            values[flag.dest] = flag.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"invalid value {raw!r} for {source}: {exc}") from None
    enabled = set()
    for c in COLLECTORS:
        on: bool | None = getattr(ns, c.dest, None)
        if on is None and c.env in environ:
            try:
                on = parse_bool(environ[c.env])
            except ValueError as exc:
                raise ConfigError(f"invalid value {environ[c.env]!r} for {c.env}: {exc}") from None
        if on is None:
            on = c.default
        if on:
            enabled.add(c.name)
    values["collectors"] = frozenset(enabled)
    cfg = Config(**values)
    _check(cfg)
    return cfg


def _check(cfg: Config) -> None:
    if cfg.collector_interval < 0.05:
        raise ConfigError("--collector.interval must be at least 50ms")
    if not 0.02 <= cfg.collector_power_interval <= cfg.collector_interval:
        raise ConfigError(
            "--collector.power-interval must be between 20ms and --collector.interval "
            f"({cfg.collector_interval:g}s), got {cfg.collector_power_interval:g}s"
        )
    if cfg.collector_health_interval < 1.0:
        raise ConfigError(f"--collector.health.interval must be at least 1s, got {cfg.collector_health_interval:g}s")
    for name, value in (("energy", cfg.collector_energy_interval), ("gpm", cfg.collector_gpm_interval)):
        # Shorter than --collector.interval means every sample (the collector rounds it up).
        if value <= 0:
            raise ConfigError(f"--collector.{name}-interval must be positive, got {value:g}s")
    if not cfg.web_telemetry_path.startswith("/"):
        raise ConfigError("--web.telemetry-path must start with '/'")
    if cfg.carbon_pue < 1.0:
        raise ConfigError(f"--carbon.pue must be at least 1.0 (facility/IT energy), got {cfg.carbon_pue:g}")
    if cfg.otlp_push_endpoint is not None and cfg.otlp_push_interval < 1.0:
        raise ConfigError(f"--otlp.push-interval must be at least 1s, got {cfg.otlp_push_interval:g}s")
    if (cfg.otlp_push_cert_file is None) != (cfg.otlp_push_key_file is None):
        raise ConfigError("--otlp.push-cert-file and --otlp.push-key-file go together: set both or neither")
    if cfg.otlp_unix_socket is not None and not os.path.isabs(cfg.otlp_unix_socket):
        raise ConfigError(f"--otlp.unix-socket must be an absolute path, got {cfg.otlp_unix_socket!r}")
    if cfg.web_listen_address[1] != 0 and cfg.web_listen_address == cfg.otlp_listen_address:
        raise ConfigError("--web.listen-address and --otlp.listen-address must differ")
    grpc_address = cfg.otlp_grpc_listen_address
    if grpc_address is not None and grpc_address[1] != 0:
        others = ((cfg.web_listen_address, "web.listen-address"), (cfg.otlp_listen_address, "otlp.listen-address"))
        for other, flag in others:
            if other == grpc_address:
                raise ConfigError(f"--otlp.grpc.listen-address and --{flag} must differ")


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Config:
    """Parse exporter flags from ``argv`` and ``environ`` into a Config, or raise ConfigError."""
    parser = new_parser()
    ns = parser.parse_args(list(argv))
    return config_from_namespace(ns, os.environ if environ is None else environ)
