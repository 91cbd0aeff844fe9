"""The daemon's configuration: flags, environment variables and their validation.

The daemon's own flags are the table below; each collector declares its own in its module
(``collectors.registry``), and ``FLAGS`` is both.

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

from gpu_energy_exporter.collectors import registry
from gpu_energy_exporter.collectors.registry import CollectorSpec
from gpu_energy_exporter.core.clientid import parse_forwarders
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.flagparser import FlagParser, did_you_mean
from gpu_energy_exporter.core.flagtypes import (  # noqa: F401 - parse_* and Flag are part of config's API
    ENV_PREFIX,
    Flag,
    any_text,
    existing_dir,
    existing_file,
    http_url,
    non_negative_float,
    one_of,
    parse_bool,
    parse_duration,
    parse_listen_address,
    parse_optional_listen_address,
    positive_float,
    positive_int,
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
    Flag("web.telemetry-path", any_text, "/metrics", "Path under which metrics are exposed.", "PATH"),
    Flag("web.config.file", existing_file, None,
         "Web configuration file (Prometheus exporter-toolkit format) enabling TLS and/or basic auth.",
         "FILE"),
    Flag("web.max-connections", positive_int, "256",
         "Most connections open at once on each port (metrics and OTLP). At the cap, a new connection "
         "closes the one idle, or sending its request, the longest.", "N"),
    Flag("web.request-timeout", parse_duration, "30s",
         "Time a client has to send a whole request, head and body, on either port (the head alone: "
         "10s at most). Past it the client gets 408 and the connection is closed.", "DURATION"),
    Flag("otlp.listen-address", parse_listen_address, f"localhost:{DEFAULT_OTLP_PORT}",
         "Address of the OTLP/HTTP receiver (POST /v1/metrics). Set to 0.0.0.0:4318 in deployments "
         "where trainers run in other containers.", "HOST:PORT"),
    Flag("otlp.max-body-bytes", positive_int, str(8 * 1024 * 1024),
         "Largest accepted OTLP request body, checked before and after gzip decompression (OTLP/gRPC: the "
         "largest message, also after decompression).", "BYTES"),
    Flag("otlp.max-points-per-request", positive_int, "16384",
         "Most data points in one OTLP request (HTTP or gRPC); a request with more is refused whole (413, gRPC "
         "INVALID_ARGUMENT) before it is decoded. Resources, scopes, metrics and what the decoding allocates are "
         "bounded in proportion (docs/security.md).", "N"),
    Flag("otlp.series-ttl", parse_duration, "10m",
         "Training series not updated for this long are dropped from /metrics.", "DURATION"),
    Flag("otlp.max-series", positive_int, "20000",
         "Most training series kept in total; points for new series beyond it are rejected.", "N"),
    Flag("otlp.max-series-per-run", positive_int, "2000",
         "Most training series kept per run id; points for new series beyond it are rejected.", "N"),
    Flag("otlp.max-bytes", positive_int, str(64 * 1024 * 1024),
         "Most estimated memory held by training series in total; points for new series beyond it are "
         "rejected, and one request may add at most a quarter of it.", "BYTES"),
    Flag("otlp.max-series-bytes", positive_int, str(256 * 1024),
         "Largest estimated size of one training series (labels times samples); bigger points are rejected.",
         "BYTES"),
    Flag("otlp.max-label-length", positive_int, "2048",
         "Longest metric name, attribute name or attribute value (characters); longer points are rejected.",
         "N"),
    Flag("otlp.max-labels-per-point", positive_int, "32",
         "Most attributes on one data point; points with more are rejected.", "N"),
    Flag("otlp.max-buckets-per-point", positive_int, "256",
         "Most buckets in one histogram data point; points with more are rejected.", "N"),
    Flag("otlp.max-quantiles-per-point", positive_int, "64",
         "Most quantiles in one summary data point; points with more are rejected.", "N"),
    Flag("otlp.max-future-skew", parse_duration, "24h",
         "Points (or stream start times) dated more than this after their request arrived are rejected "
         "(a point's time only orders its stream: a trainer's or the exporter's clock stepped by an hour "
         "loses nothing).",
         "DURATION"),
    Flag("otlp.max-new-runs-per-request", positive_int, "16",
         "Most new run ids one request may start; their points beyond it are rejected (a flood of run ids "
         "cannot lock out other trainers).", "N"),
    Flag("otlp.max-new-series-per-request", positive_int, "2000",
         "Most new training series one request may create; series that already exist always update.", "N"),
    Flag("otlp.evict-idle-after", parse_duration, "2m",
         "When the series or byte limit is reached, series not updated for this long are dropped to make "
         "room (before --otlp.series-ttl).", "DURATION"),
    Flag("otlp.bearer-token-file", existing_file, None,
         "If set, OTLP pushes must carry 'Authorization: Bearer <token>' with a token from this file: the "
         "whole file is one token, or each line is '<tenant> <token>' (per-tenant tokens: a push's identity is "
         "then its token's tenant, whatever the network path; docs/security.md).",
         "FILE"),
    Flag("otlp.unix-socket", any_text, None,
         "Also receive OTLP on this Unix-domain socket (OTLP/HTTP, and OTLP/gRPC when "
         "--otlp.grpc.listen-address is on), e.g. /run/gpu-energy-exporter/otlp.sock, the path the training "
         "helper uses when it exists. Mode 0666: any local user may connect; each connection is identified by "
         "the kernel (SO_PEERCRED), not by what it sends.", "PATH"),
    Flag("otlp.trusted-forwarders", parse_forwarders, "",
         "Comma-separated pushers trusted to vouch for their clients' host.name and process.pid (an "
         "OpenTelemetry Collector): uid=N (a local Collector's user), an address or network (10.0.0.7, "
         "10.1.0.0/16) or tenant=NAME (a per-tenant token). Other pushers' attributes are claims checked "
         "against their own identity (docs/security.md).", "LIST"),
    Flag("otlp.max-series-per-client", positive_int, "5000",
         "Most training series one identity (a process as the kernel sees it, a tenant, an address) may hold; "
         "its points for new series beyond it are rejected, other identities' are not (the global "
         "--otlp.max-series stays the last bound).", "N"),
    Flag("otlp.max-bytes-per-client", positive_int, str(16 * 1024 * 1024),
         "Most estimated memory one identity's training series may hold (within --otlp.max-bytes).", "BYTES"),
    Flag("otlp.grpc.listen-address", parse_optional_listen_address, f"localhost:{DEFAULT_OTLP_GRPC_PORT}",
         "Address of the OTLP/gRPC receiver (MetricsService/Export), sharing the OTLP/HTTP receiver's store, "
         "limits and bearer token; TLS from --web.config.file's tls_server_config. Empty turns it off. The port "
         "is bound at start; in plain text grpc is loaded when the first client connects (with TLS, at start).",
         "HOST:PORT"),
    Flag("otlp.push-endpoint", http_url, None,
         "Also push this node's readings over OTLP/HTTP to this URL (e.g. http://collector:4318/v1/metrics), "
         "named after the OpenTelemetry hardware semantic conventions. Off when unset.", "URL"),
    Flag("otlp.push-interval", parse_duration, "10s", "How often readings are pushed to --otlp.push-endpoint.",
         "DURATION"),
    Flag("otlp.push-headers-file", existing_file, None,
         "File of HTTP headers sent with every push, one 'Name: value' per line (e.g. an API key).", "FILE"),
    Flag("otlp.push-ca-file", existing_file, None,
         "CA certificate(s) that verify an https:// --otlp.push-endpoint (default: the system's).", "FILE"),
    Flag("otlp.push-cert-file", existing_file, None, "Client certificate for mutual TLS with the push endpoint.",
         "FILE"),
    Flag("otlp.push-key-file", existing_file, None, "Private key of --otlp.push-cert-file.", "FILE"),
    Flag("otlp.push-insecure-skip-verify", parse_bool, "false",
         "Do not verify the push endpoint's TLS certificate (testing only).", "BOOL"),
    Flag("collector.interval", parse_duration, "1s",
         "How often GPUs and the host are sampled (the snapshot /metrics serves).", "DURATION"),
    Flag("path.procfs", existing_dir, "/proc",
         "procfs mount point: host CPU and memory are read there (the exporter's own process_* series keep "
         "/proc/self).", "PATH"),
    Flag("carbon.intensity", non_negative_float, None,
         "Grid carbon intensity in gCO2e/kWh. Overrides --carbon.region. Default: world average "
         "(see docs/measurement.md).", "G_PER_KWH"),
    Flag("carbon.region", any_text, None,
         "Country (ISO 3166-1 alpha-3, e.g. FRA) or cloud region (e.g. gcp:europe-west1) "
         "whose carbon intensity to use from the bundled table.", "CODE"),
    Flag("carbon.intensity-file", existing_file, None,
         "File holding the current carbon intensity in gCO2e/kWh (one number), re-read when it "
         "changes, for a time-varying grid.", "FILE"),
    Flag("carbon.pue", positive_float, "1.0",
         "Power usage effectiveness of the data centre (facility energy / IT energy), >= 1.", "RATIO"),
    Flag("runs.csv", any_text, None,
         "Append one row per finished training run to this CSV file (a JSON summary per run is "
         "written beside it).", "FILE"),
    Flag("runs.warmup", parse_duration, "30s",
         "Start of each run excluded from its efficiency figures (J/token, tokens/s).", "DURATION"),
    Flag("runs.stale-after", parse_duration, "5m",
         "A run that pushed nothing for this long is finished as stale.", "DURATION"),
    Flag("runs.state-dir", any_text, None,
         "Directory of the run ledger's database (runs.db): open runs and rows not yet written survive a "
         "restart or an upgrade (SIGTERM or SIGKILL) and continue as the same runs. Default: .runs-state "
         "beside --runs.csv; without either (or --runs.db), runs are kept in memory only. It must be owned "
         "by the exporter's user and writable by no one else, or it is refused (docs/ledger.md). Put it on a "
         "local disk.", "DIR"),
    Flag("runs.db", any_text, None,
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
    Flag("runs.max-active-per-client", positive_int, "64",
         "Most runs with training progress one identity (a process as the kernel sees it, a tenant, an "
         "address: docs/security.md) may have going at once in the "
         "ledger; its further new runs are refused (counted) until one ends.", "RUNS"),
    Flag("runs.max-new-per-client", positive_int, "60",
         "Most runs one identity may start per minute in the ledger (a token bucket holding "
         "a minute's worth); its further new runs stay tentative, charged nothing and never written.",
         "RUNS_PER_MINUTE"),
    Flag("runs.max-finished-per-client", positive_int, "60",
         "Most runs one identity may finish per minute (each finished run writes a CSV row and "
         "a JSON summary); a refused finish leaves the run going until a later push or --runs.stale-after.",
         "RUNS_PER_MINUTE"),
    Flag("runs.claim-grace", parse_duration, "30s",
         "How long after a run's start a GPU it names may go without NVML listing one of its processes "
         "(CUDA start-up); meanwhile it shares only energy no other run's process uses. After it, an "
         "unconfirmed GPU claim is charged nothing (docs/ledger.md).", "DURATION"),
    Flag("log.level", one_of("debug", "info", "warn", "error"), "info", "Log level.", "LEVEL"),
    Flag("log.format", one_of("logfmt", "json"), "logfmt", "Log format.", "FORMAT"),
)

GENERAL_FLAGS = FLAGS
#: Every flag: the daemon's, then each collector's own (``collectors.registry``, declared in its module).
FLAGS = GENERAL_FLAGS + registry.collector_flags()
#: Every collector, in build order: ``--collector.<name>`` / ``--no-collector.<name>``.
COLLECTORS: tuple[CollectorSpec, ...] = registry.specs()
_COLLECTOR_DEFAULTS = {f.dest: f for f in registry.collector_flags()}


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
    path_procfs: str = "/proc"
    carbon_intensity: float | None = None
    carbon_region: str | None = None
    carbon_intensity_file: str | None = None
    carbon_pue: float = 1.0
    runs_csv: str | None = None
    runs_warmup: float = 30.0
    runs_stale_after: float = 300.0
    runs_state_dir: str | None = None
    runs_db: str | None = None
    runs_journal_interval: float = 5.0
    runs_claim_grace: float = 30.0
    runs_max_backdate: float = 10.0
    runs_max_active_per_client: int = 64
    runs_max_new_per_client: int = 60
    runs_max_finished_per_client: int = 60
    log_level: str = "info"
    log_format: str = "logfmt"
    collectors: frozenset[str] = field(
        default_factory=lambda: frozenset(c.name for c in COLLECTORS if c.default)
    )

    #: the values of the collectors' own flags (``collectors.registry``), by ``dest``; one not given here
    #: is its flag's default. Read as attributes: ``config.collector_energy_interval``.
    options: Mapping[str, Any] = field(default_factory=dict)

    def enabled(self, collector: str) -> bool:
        return collector in self.collectors

    def __getattr__(self, name: str) -> Any:
        """A collector's flag's value (only names no field has reach here)."""
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        flag = _COLLECTOR_DEFAULTS.get(name)
        if flag is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return None if flag.default is None else flag.parse(flag.default)


class _Parser(FlagParser):
    """The exporter's parser: raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{did_you_mean(message, self.known_flags())} (see --help)")


def add_exporter_flags(parser: argparse.ArgumentParser) -> None:
    """Add every exporter flag to ``parser`` (also used by sub-commands that start an exporter)."""
    group = parser.add_argument_group("exporter flags (each also settable as GPU_ENERGY_EXPORTER_<FLAG>)")
    for flag in GENERAL_FLAGS:
        _add_flag(group, flag)
    cgroup = parser.add_argument_group("collectors (--collector.<name> enables, --no-collector.<name> disables)")
    for c in COLLECTORS:
        cgroup.add_argument(
            "--collector." + c.name, dest=c.dest, action=argparse.BooleanOptionalAction, default=None,
            help=f"{c.help} (default: {'enabled' if c.default else 'disabled'}) [env {c.env}]",
        )
    for c in COLLECTORS:
        if c.flags:
            own = parser.add_argument_group(f"{c.name} collector flags (no effect while --no-collector.{c.name})")
            for flag in c.flags:
                _add_flag(own, flag)


def _add_flag(group: Any, flag: Flag) -> None:
    default = f" (default: {flag.default})" if flag.default is not None else ""
    if flag.boolean:
        group.add_argument("--" + flag.name, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{flag.help}{default} [env {flag.env}]")
    else:
        group.add_argument("--" + flag.name, dest=flag.dest, metavar=flag.metavar, default=None,
                           help=f"{flag.help}{default} [env {flag.env}]")


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
    values["options"] = {dest: values.pop(dest) for dest in _COLLECTOR_DEFAULTS}
    cfg = Config(**values)
    _check(cfg)
    for c in COLLECTORS:
        if c.check is not None:
            c.check(cfg)
    return cfg


def _check(cfg: Config) -> None:
    if cfg.collector_interval < 0.05:
        raise ConfigError("--collector.interval must be at least 50ms")
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
