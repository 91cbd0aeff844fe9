"""Generate the reference docs from the code: ``docs/metrics.md`` (the metric catalogue) and
``docs/configuration.md`` (flags, environment variables, collectors, carbon regions).

``python -m gpu_energy_exporter.tools.docgen`` writes them; ``--check`` exits 1 if a committed file differs
(the test suite runs the check, so the docs cannot drift from the code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from gpu_energy_exporter.collectors import registry
from gpu_energy_exporter.core.metrics import CATALOGUE
from gpu_energy_exporter.daemon.config import COLLECTORS, FLAGS

#: Every module outside the collectors that declares metrics; importing them fills the catalogue (each
#: collector's module is imported by the registry, ``registry.specs()``).
METRIC_MODULES = (
    "gpu_energy_exporter.engine.sampler",
    "gpu_energy_exporter.engine.exposition",
    "gpu_energy_exporter.otlp.selfmetrics",
    "gpu_energy_exporter.otlp.grpcreceiver",
    "gpu_energy_exporter.ledger.specs",
    "gpu_energy_exporter.otlp.push",
    "gpu_energy_exporter.http.server",
)

#: The sections of the metric catalogue that are not a collector's (a collector's title is in its spec).
_SECTION_TITLES = {
    "otlp": "OTLP receiver self-metrics",
    "otlp_push": "OTLP push self-metrics (`--otlp.push-endpoint`)",
    "ledger": "Training runs, from the run ledger",
}


def load_catalogue() -> None:
    for module in METRIC_MODULES:
        importlib.import_module(module)
    registry.specs()


def _section_titles() -> dict[str, str]:
    """The catalogue's sections in order: the exporter's, each collector's (the registry's), then the rest."""
    titles = {"exporter": "Exporter self-metrics"}
    titles.update((c.name, c.title) for c in registry.specs() if c.title)
    titles.update(_SECTION_TITLES)
    return titles


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def metrics_markdown() -> str:
    load_catalogue()
    from gpu_energy_exporter.core import contract as instruments
    from gpu_energy_exporter.otlp.naming import metric_name

    out = [
        "# Metric catalogue",
        "",
        "Generated from the code by `python -m gpu_energy_exporter.tools.docgen`; do not edit by hand.",
        "",
        "Every per-GPU series carries `gpu` (the NVML index, which is not the `CUDA_VISIBLE_DEVICES` index) and",
        "`gpu_uuid` (stable, globally unique: the join key). Prometheus adds `instance` and `job` at scrape time.",
        "Also exposed: `gpuenergy_process_*` (the exporter's own CPU seconds, resident memory, open files): the",
        "series of prometheus_client's process collector, read from /proc at most once a second (scrapes less",
        "than a second apart serve the same reading).",
        "",
    ]
    by_collector: dict[str, list] = {}
    for spec in CATALOGUE.values():
        by_collector.setdefault(spec.collector, []).append(spec)
    titles = _section_titles()
    order = list(titles) + sorted(set(by_collector) - set(titles))
    for collector in order:
        specs = by_collector.get(collector)
        if not specs:
            continue
        out += [f"## {titles.get(collector, collector)}", "", "| metric | type | labels | description |",
                "|---|---|---|---|"]
        for spec in sorted(specs, key=lambda s: s.name):
            labels = ", ".join(f"`{label}`" for label in spec.labels) or "–"
            out.append(f"| `{spec.name}` | {spec.kind} | {labels} | {_escape(spec.help)} |")
        out.append("")
    out += [
        "## Training series (pushed by trainers over OTLP)",
        "",
        "Names as the OpenTelemetry → Prometheus compatibility rules give them, so they are the same whether",
        "they arrive through this exporter's receiver, an OpenTelemetry Collector or Prometheus's own OTLP",
        "receiver. Every series carries `run_id`, `rank` and `gpu_uuid` (comma-joined when a process uses",
        "several GPUs). See [training.md](training.md).",
        "",
        "| metric | OpenTelemetry instrument | kind | unit | description |",
        "|---|---|---|---|---|",
    ]
    for inst in instruments.ALL:
        prom = metric_name(inst.name, inst.unit, inst.kind)
        out.append(f"| `{prom}` | `{inst.name}` | {inst.kind} | `{inst.unit or '–'}` | "
                   f"{_escape(inst.description)} |")
    out.append("")
    out += push_mapping_markdown()
    return "\n".join(out)


def push_mapping_markdown() -> list[str]:
    """The --otlp.push-endpoint table: each /metrics series, the OTLP metric pushed for it, and the name
    Prometheus 3's OTLP receiver gives that metric under its default translation."""
    from gpu_energy_exporter.otlp.conventions import (
        CONVENTIONS,
        MEMORY_FRACTION,
        RAPL_HW_TYPES,
        own_name,
        pushed,
    )
    from gpu_energy_exporter.otlp.naming import metric_name

    out = [
        "## Pushed over OTLP (`--otlp.push-endpoint`)",
        "",
        "With `--otlp.push-endpoint` the exporter also pushes every series below (from the same snapshot that",
        "`/metrics` serves) to an OTLP/HTTP endpoint. Where the OpenTelemetry hardware semantic conventions",
        "define a metric it is used, with `hw.type`, `hw.id` (the GPU UUID), `hw.name` (`gpu<index>`),",
        "`hw.vendor`, `hw.model` and `hw.driver_version`; other series keep this project's name, split as",
        "`gpuenergy.<subsystem>.<name>` with the unit in the OTLP unit field and the same labels as attributes,",
        "so Prometheus' translation gives back the `/metrics` name. Info series travel as attributes;",
        "per-process series are not pushed. The last column is what Prometheus 3's OTLP receiver (default",
        "`UnderscoreEscapingWithSuffixes`) stores: the name to query.",
        "",
        "| /metrics series | OTLP metric | kind | unit | name in Prometheus 3 via OTLP |",
        "|---|---|---|---|---|",
    ]
    kinds = {"counter": "monotonic sum", "updown": "non-monotonic sum", "gauge": "gauge"}

    def prom3(name: str, unit: str, kind: str) -> str:
        return metric_name(name, unit, "updown" if kind == "updown" else kind)  # type: ignore[arg-type]

    for spec in sorted(CATALOGUE.values(), key=lambda s: s.name):
        if not pushed(spec):
            continue
        conv = CONVENTIONS.get(spec.name)
        if conv is not None:
            name, unit, kind = conv.name, conv.unit, conv.kind
            note = " (`hw.state` ok/failed)" if name == "hw.status" else ""
            note += " (`hw.type=temperature`, `hw.parent` = GPU)" if name == "hw.temperature" else ""
        else:
            (name, unit), kind, note = own_name(spec), ("counter" if spec.kind == "counter" else "gauge"), ""
            if spec.name == "gpuenergy_rapl_energy_joules_total":
                types = ", ".join(f"{scope} → `hw.type={t}`" for scope, t in RAPL_HW_TYPES.items())
                note = f"; zones of scope {types} as `hw.energy` instead"
        out.append(f"| `{spec.name}` | `{name}`{note} | {kinds[kind]} | `{unit or '–'}` | "
                   f"`{prom3(name, unit, kind)}` |")
    m = MEMORY_FRACTION
    out.append(f"| (used ÷ total memory) | `{m.name}` | gauge | `{m.unit}` | `{prom3(m.name, m.unit, m.kind)}` |")
    out.append("")
    return out


def _http_limits() -> list[str]:
    from gpu_energy_exporter.http import connection, parsing
    from gpu_energy_exporter.http import server as h
    from gpu_energy_exporter.http.basicauth import AUTH_CACHE_MAX
    from gpu_energy_exporter.otlp.receiver import INLINE_MAX_BODY

    inline_kib = INLINE_MAX_BODY // 1024

    return [
        "## HTTP servers: limits and why",
        "",
        "Both ports (metrics and OTLP) run the same small server (`gpu_energy_exporter/http/server.py`). One",
        "selector thread per port accepts connections, performs TLS handshakes, reads requests and writes",
        f"responses without blocking; a fixed pool of {h.DEFAULT_WORKERS} worker threads per port runs the",
        "handlers, and only a complete request reaches it. So a client that trickles its request, sends",
        "nothing, or does not read its response costs a buffer and a file descriptor, never a thread, and",
        "cannot keep `/metrics`, the health endpoints or the OTLP receiver from answering (a thread per",
        "connection, as before, let 512 slow connections take every port down). One exception: an",
        f"uncompressed OTLP push of at most {inline_kib} KiB (one rank's export is a few KiB) is handled on the",
        "OTLP port's selector thread itself, since storing it costs less than handing it to a worker and",
        "back; larger or compressed pushes go to the pool.",
        "",
        f"- **Deadlines** count from a request's first byte, not per read: the head within "
        f"{h.DEFAULT_HEAD_TIMEOUT:g}s, the whole request (body included) within `--web.request-timeout`; "
        "past either the client gets 408 and the connection is closed. A keep-alive connection may stay idle "
        f"{h.DEFAULT_IDLE_TIMEOUT:g}s; a response must be written within `--web.request-timeout`.",
        "- **Connections**: at most `--web.max-connections` per port. At the cap a new connection closes the "
        "connection that has been idle, or sending its request, the longest (oldest first); failing that, the "
        "one whose answer has waited longest (over a second) for its client to read it. Requests being handled "
        "are never cut. A scraper's fresh connection is the newest, so a flood of slow, idle or non-reading "
        "connections cannot lock it out. Answers waiting for slow readers are capped at "
        f"{connection.MAX_PENDING_OUT >> 20} MiB per port (the longest-waiting is cut beyond). The exporter raises its "
        "open-files soft limit to the hard one at start-up (as Go programs do) and lowers the cap, with a "
        "warning, where a third of that limit would not hold it.",
        f"- **Memory**: request heads up to {parsing.MAX_HEAD // 1024} KiB (431 beyond; request line "
        f"{parsing.MAX_REQUEST_LINE // 1024} KiB, 414), bodies up to {h.DEFAULT_MAX_BODY_BYTES // 1024} KiB on the "
        "metrics port and `--otlp.max-body-bytes` on the OTLP port (413), and four bodies' worth in flight "
        "per port (503 beyond).",
        "- **Strict parsing**: HTTP/1.0 and 1.1 only (HTTP/0.9 gets 400, others 505); one `Content-Length` "
        "of ASCII digits; `Transfer-Encoding: chunked` only, never with `Content-Length`; chunk sizes in hex "
        f"(no sign), chunk lines up to {parsing.MAX_CHUNK_LINE} bytes, trailers up to {parsing.MAX_TRAILERS // 1024} "
        "KiB; no header line folding. Client faults are answered with 4xx and logged at debug level, "
        "without a traceback.",
        f"- **Basic auth** (`--web.config.file`): results are cached (up to {AUTH_CACHE_MAX} credentials, "
        "keyed by an HMAC, never the password), as exporter-toolkit does. Checks that need bcrypt run on "
        f"{h.AUTH_WORKERS} threads of their own with at most {h.AUTH_QUEUE} waiting; beyond that the "
        "client gets 429 with `Retry-After: 1` at once. A password-guessing flood therefore costs at most "
        "two cores and never delays a scraper whose credentials are cached.",
        "",
        "Measured with `bench/http_abuse.py`: see [benchmarks.md](benchmarks.md).",
    ]


def _grpc_limits() -> list[str]:
    from gpu_energy_exporter.otlp import grpcfront as front
    from gpu_energy_exporter.otlp import grpcreceiver as g
    from gpu_energy_exporter.otlp.receiver import INLINE_MAX_BODY

    return [
        "## OTLP/gRPC receiver: limits and why",
        "",
        "`--otlp.grpc.listen-address` (default `localhost:4317`, off when empty) serves",
        f"`{g.SERVICE}/{g.METHOD}` with `grpcio`'s asyncio server on one thread of its own. Each",
        "message goes through the function an OTLP/HTTP body goes through: the same store, run ledger,",
        "`--otlp.*` limits and `partial_success` answers.",
        "",
        "- **Loaded on first use**: in plain text the port is bound at start by a plain socket (a port in use stops",
        "  the exporter at start, as any port does) and `grpc` is loaded only when the first client connects; a",
        "  node that never receives a gRPC push never pays for it (9.6 MB of RSS and 7 threads on a 2-core",
        "  machine; the receiver loaded cost 14 MB and 20 threads on an H100 node). That first connection is",
        "  answered as an HTTP/2 server would and, once the client has opened its call on it, with HTTP/2's",
        "  `GOAWAY` saying that no call on it was processed, while the port's listening sockets go to the front",
        "  (below), which relays to grpcio: a gRPC client sends the call again on a new connection, by itself",
        "  (the OpenTelemetry SDK's exporter and a bare grpcio call with no retry policy succeed at once, with no",
        "  error and no retry of their own). The port is never closed on the way. The first call of a client",
        "  that turned grpcio's retries off (`grpc.enable_retries=0`) fails (\"Stream removed (GOAWAY",
        "  received)\"). With TLS configured, `grpc` is loaded at start. With `--collector.kubernetes` the grpc",
        "  module is loaded anyway (the kubelet client); the server's threads and buffers still wait.",
        "- **Codes**: a message that does not decode is `INVALID_ARGUMENT` with the HTTP receiver's 400 message;",
        "  a missing or wrong bearer token (`authorization: Bearer <token>` metadata, `--otlp.bearer-token-file`)",
        "  is `UNAUTHENTICATED`; a message over `--otlp.max-body-bytes`, as sent or after gzip, is",
        "  `RESOURCE_EXHAUSTED` (gRPC stops inflating at the limit, so a gzip bomb costs at most that much).",
        f"- **Memory**: at most {g.SLOTS} calls receive or are handled at once, so at most {g.SLOTS} messages of",
        "  `--otlp.max-body-bytes` are held (as the HTTP port's four bodies in flight); other calls wait with one",
        "  64 KiB flow-control window each (gRPC's bandwidth probing is off: with it, waiting calls buffer their",
        "  whole messages: 30 calls of 4 MiB held waiting for 6 s cost a bare grpcio server 3 MB, 123 MB with",
        "  probing on). A refused call's message is dropped with the call (grpcio keeps a failed call's",
        "  traceback, and with it whatever the handler's frames held). The peak is then the slots' messages,",
        "  each held about three times while read and parsed (grpcio's buffer, the bytes, the parse: 4 x 3 x",
        "  4 MiB here), grpcio's state per connection and malloc's arenas: 128 calls of 4 MiB at once, each on",
        "  its own connection, raised the exporter's peak RSS by 57 to 76 MB on a loaded 2-core machine, and",
        "  rounds of such floods do not add up (before: 4 MiB kept per refused call, +504 MB for one such",
        "  round, +620 MB after three of 64). Smaller grpcio read chunks or stream windows did not lower it.",
        "  Require `--otlp.bearer-token-file` where pushers are not trusted (a call without the token is",
        "  refused before its message is read). Uncompressed messages up to "
        f"{INLINE_MAX_BODY // 1024} KiB are stored on the receiver's thread, larger ones on {g.WORKERS} workers.",
        "- **Slow clients**: a call must deliver its message within `--web.request-timeout` of its start",
        "  (`DEADLINE_EXCEEDED`); while calls wait for a slot, the call that has been receiving longest, for over",
        f"  {g.EVICT_AFTER:g}s, is cut (`UNAVAILABLE`, which clients retry), so slow senders cannot hold the port.",
        "- **Connections** (`otlp/grpcfront.py`): the port is held by a front that relays each connection to",
        "  grpcio, which listens on a Unix socket in a private (0700) temporary directory, once the connection",
        "  has sent its first bytes (a gRPC client sends its preface, a TLS client its ClientHello, with its first",
        f"  packet). A connection silent for {g.HANDSHAKE_TIMEOUT:g}s (or `--web.request-timeout` if shorter) is",
        "  closed without grpcio ever seeing it. At most `--web.max-connections` connections, silent or relayed:",
        "  at the cap a new one closes the one silent the longest, failing that the relayed one idle the longest",
        f"  (no byte either way for {front.IDLE_EVICT_S:g}s; a gRPC client opens a new connection for its next call),",
        "  as the HTTP ports do; failing both the new one is closed. So sockets that never say a word, however",
        "  many and however fast they are reopened, never keep out a client that talks: 300 of them reopened as",
        "  closed failed 8 of 8 legitimate exports before, none now (`tests/test_otlp_grpc_front.py`). Behind",
        f"  the front grpcio allows {g.STREAMS_PER_CONNECTION} calls on each connection and",
        "  `--web.max-connections` calls in all (`RESOURCE_EXHAUSTED` beyond), a TLS handshake and preface within",
        f"  {g.HANDSHAKE_TIMEOUT_TLS:g}s, and closes a connection with no call for {g.IDLE_TIMEOUT:g}s (GOAWAY; a",
        "  client reconnects for its next export). What remains: connections that keep sending bytes are relayed",
        "  and held, up to the cap (docs/security.md). The receiver maps each relayed connection back to its TCP",
        "  peer, so per-client bounds count what they counted before.",
        "  `SO_REUSEPORT` is off: a second exporter on the same port fails to start instead of sharing it.",
        "- **TLS**: from `--web.config.file`'s `tls_server_config` (certificate and key, `client_auth_type` with",
        "  `client_ca_file`), re-read on the next connection after the files change. `RequireAnyClientCert` and",
        "  `RequireAndVerifyClientCert` require a certificate signed by the client CA; `VerifyClientCertIfGiven`",
        "  serves clients as `NoClientCert` does. What grpcio cannot enforce (`client_allowed_sans`, TLS",
        "  versions other than 1.2 to 1.3, `cipher_suites`) stops the exporter at start-up, naming the setting.",
        "  The file's basic auth and `rate_limit` apply to the HTTP ports only. The OTLP/HTTP port has no TLS.",
        "- **Self-metrics**: `gpuenergy_otlp_grpc_requests_total{code}`, `gpuenergy_otlp_grpc_calls_in_flight`,",
        "  `gpuenergy_otlp_grpc_request_duration_seconds_total`; points, rejections and series are counted with",
        "  the HTTP receiver's (`gpuenergy_otlp_points_*`).",
    ]


def configuration_markdown() -> str:
    from gpu_energy_exporter.reference import carbon

    out = [
        "# Configuration reference",
        "",
        "Generated from the code by `python -m gpu_energy_exporter.tools.docgen`; do not edit by hand.",
        "",
        "Every flag can also be set through the environment variable shown (a flag on the command line wins).",
        "Durations take Prometheus's form (`100ms`, `1s`, `5m`, `1h30m`); a bare number such as `5` is refused",
        "(write `5s`), except `0`. Addresses are `host:port`, `:port` (all interfaces) or `[ipv6]:port`. Flags",
        "are never abbreviated (`--web.listen` is an error, not `--web.listen-address`). An invalid value stops",
        "the exporter before it starts, with one line naming the flag or variable and what is accepted.",
        "",
        "## Flags",
        "",
        "| flag | environment variable | default | description |",
        "|---|---|---|---|",
    ]
    for f in FLAGS:
        default = f"`{f.default}`" if f.default is not None else "unset"
        usage = f"--[no-]{f.name}" if f.boolean else f"--{f.name}={f.metavar}"
        out.append(f"| `{usage}` | `{f.env}` | {default} | {_escape(f.help)} |")
    out += [
        "",
        "## OTLP receiver limits",
        "",
        "Every `--otlp.max-*` limit but one refuses the data points that break it, not the request: the rest",
        "of the request is stored, and the response's `partial_success` gives `rejected_data_points` and, per",
        "reason, a message naming the limit and its flag. `gpuenergy_otlp_points_rejected_total{reason}` counts",
        "them.",
        "",
        "- What decoding makes: a request of more than `--otlp.max-points-per-request` data points, or one",
        "  whose decoding would allocate more than that flag allows (resources, scopes and metrics, every",
        "  message and attribute at any depth, labels, buckets and quantiles once translated: counted from the",
        "  wire format before the body is parsed), is refused whole before it is decoded: HTTP 413, gRPC",
        "  `INVALID_ARGUMENT`, with a message naming the bound and the flag. The defaults keep any one request",
        "  under +64 MB of the exporter's memory; docs/security.md gives the bounds and the figures.",
        "- Size: metric, attribute names and values (`--otlp.max-label-length`), attributes per point, buckets",
        "  and quantiles per point, and the estimated size of one series (`--otlp.max-series-bytes`) are checked",
        "  before anything is stored; the store as a whole holds at most `--otlp.max-bytes` (estimated; see",
        "  `gpuenergy_otlp_store_bytes`) and `--otlp.max-series` series.",
        "- Junk: counters, histogram and summary sums must be finite (`non_finite`); gauges may be NaN or",
        "  +-Inf, as in Prometheus. Points dated more than `--otlp.max-future-skew` ahead of the exporter's",
        "  clock (24 h by default) are refused (`future_timestamp`), so a wild clock cannot create runs that",
        "  never end; within it a point's time only orders its stream (docs/ledger.md, Time).",
        "- Fair admission: one request may start at most `--otlp.max-new-runs-per-request` new run ids, create",
        "  `--otlp.max-new-series-per-request` new series and add a quarter of `--otlp.max-bytes`; series that",
        "  already exist always update. When the store is full, series idle for `--otlp.evict-idle-after` are",
        "  evicted to make room (`gpuenergy_otlp_series_evicted_total`). A client that keeps refreshing a flood",
        "  keeps what it got, within its identity's quota (below). Points refused by a per-request allowance",
        "  are admitted from the next export; with cumulative temporality (the SDK's default) their value is",
        "  then complete, with delta temporality the refused deltas are lost.",
        "- Identity (docs/security.md): each pusher is an identity the exporter establishes (the process the",
        "  kernel names for a loopback or Unix-socket connection, a per-tenant token's tenant, else the peer's",
        "  address), never what its attributes say. Each identity holds at most `--otlp.max-series-per-client`",
        "  series and `--otlp.max-bytes-per-client` bytes (`client_series_limit`, `client_bytes_limit`), so one",
        "  identity's flood never keeps another out; a `process.pid` that is not the pushing process is refused",
        "  (`identity_mismatch`); a series belongs to the principal that created it (`not_series_owner`); the",
        "  run ledger decides who may change which run before a point is stored (`not_run_owner`, `foreign_rank`,",
        "  `client_new_runs`, ... as in docs/ledger.md), and a point pushed under a run id another identity holds",
        "  is stored under the pusher's own `<run id>~<tag>` (`gpuenergy_otlp_run_id_collisions_total`).",
        "- Names: a pushed metric whose exposition would reuse a name of another pushed metric (`s` summary",
        "  and `s_count` gauge, `x_total` counter and `x` gauge, `h` histogram and `h_bucket`) or a reserved",
        "  one (`target_info`, `target`, `up`, `scrape_*`, `gpuenergy_*`) is refused (`name_collision`,",
        "  `invalid_name`): the one pushed first keeps the name, and `/metrics` always parses (`promtool check",
        "  metrics` finds no error). Its style lint may still flag a pushed name as the trainer chose it",
        "  (`_milliseconds`, camelCase, a gauge ending in `_count`): such names are kept, as the Collector and",
        "  Prometheus's own OTLP receiver keep them.",
        "- The training contract: the helper's instrument names (`training_tokens_total`,",
        "  `training_run_finished`, ... in docs/training.md) accept only their own type and attributes",
        "  (`run_id`, `rank`, `gpu_uuid`; `training_run_info` its metadata too) and need a `run_id`; any other",
        "  point that would take or shadow one of them (a gauge `training_tokens`, a counter",
        "  `training_run_finished`) is refused alone (`contract_violation`), so it never keeps real runs'",
        "  points out. Which client may finish, join or continue a run, and the per-client bounds on runs",
        "  (`--runs.max-*-per-client`), are the ledger's: docs/ledger.md.",
        "",
        "## Collectors",
        "",
        "`--collector.<name>` enables a collector, `--no-collector.<name>` disables it; the environment",
        "variable takes `true`/`false`.",
        "",
        "| collector | default | environment variable | what it collects |",
        "|---|---|---|---|",
    ]
    for c in COLLECTORS:
        out.append(f"| `{c.name}` | {'enabled' if c.default else 'disabled'} | `{c.env}` | {_escape(c.help)} |")
    out += ["", "A flag that configures one collector has no effect while that collector is disabled: the exporter "
            "then warns at start, naming the flag to add (`--collector.slurm.job-mapping-dir` alone does not "
            "enable the slurm collector; add `--collector.slurm`). Those flags, by collector: "
            + "; ".join(f"{c.name}: " + ", ".join(f"`--{f.name}`" for f in FLAGS if f.collector == c.name)
                        for c in COLLECTORS if any(f.collector == c.name for f in FLAGS)) + "."]
    out += ["", *_http_limits(), "", *_grpc_limits()]
    out += [
        "",
        "## Sub-commands",
        "",
        "`gpu-energy-exporter runs`, `top`, `report` and `demo`: see `gpu-energy-exporter <command> --help`,",
        "[ledger.md](ledger.md) and [workstation.md](workstation.md).",
        "",
        "## Carbon intensity regions (`--carbon.region`)",
        "",
        f"Without a region, flag or file the exporter uses the world average, {carbon.WORLD_DEFAULT_G_PER_KWH:g} "
        f"gCO2e/kWh ({carbon.WORLD_DEFAULT_YEAR}), labelled `source=\"default\"`. Sources and licences of the "
        "tables: `gpu_energy_exporter/reference/data/SOURCES.md`.",
        "",
        "| code | region | gCO2e/kWh | year |",
        "|---|---|---|---|",
    ]
    for table in (carbon.country_table(), carbon.cloud_table()):
        for code in sorted(table):
            row = table[code]
            out.append(f"| `{row.code}` | {_escape(row.name)} | {row.grams_per_kwh:g} | {row.year} |")
    out.append("")
    return "\n".join(out)


DOCS = {"metrics.md": metrics_markdown, "configuration.md": configuration_markdown}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_energy_exporter.tools.docgen", description=__doc__)
    parser.add_argument("--docs", default=str(Path(__file__).resolve().parents[2] / "docs"))
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, render in DOCS.items():
        path = Path(args.docs) / name
        text = render()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        hint = " (run: python -m gpu_energy_exporter.tools.docgen)"
        print("out of date: " + ", ".join(stale) + hint, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
