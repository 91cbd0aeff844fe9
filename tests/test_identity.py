"""Issue 29, items 1-3: who pushed a point, as the exporter establishes it.

- the rules on plain values (``core.clientid``: identities, claims, forwarders; the store's per-identity quotas
  and series ownership; the ledger's run-id collisions);
- the kernel's view on real sockets (``http.peers``: the socket table for loopback TCP from another process,
  ``SO_PEERCRED`` on a Unix socket, what is left without the peer's /proc);
- the exporter end to end: the OTLP Unix socket (HTTP and gRPC, the helper using it), per-tenant tokens,
  trusted forwarders, and 200 helper-like ranks over HTTP with 50 over gRPC losing no token.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import neighbour
import pytest
from helpers import ExporterProcess, sample_value, samples, wait_until

from gpu_energy_exporter.core import clientid
from gpu_energy_exporter.core.clientid import (
    address_peer,
    claim_refusal,
    client_id,
    forwarder_matches,
    identity_of,
    kernel_peer,
    node_of,
    parse_forwarders,
    principal_of,
    tag_of,
)
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.http.peers import PeerResolver, credentials, table_keys

RES = (("host_name", "node-a"), ("process_pid", "4242"), ("service_instance_id", "u-1"))


# ----------------------------------------------------------------------------------------------------
# the rules


def test_claims_narrow_an_identity_and_never_widen_it() -> None:
    me = kernel_peer(1000, 4242, "77", ns_pids=(4242, 7))
    other = kernel_peer(1000, 5151, "88")
    a, b = client_id(me, RES), client_id(me, (*RES[:2], ("service_instance_id", "u-2")))
    assert a != b and identity_of(a) == identity_of(b)  # two helpers in one process: two clients, one identity
    forged = client_id(other, RES)  # the same claims from another process
    assert forged != a and identity_of(forged) != identity_of(a)
    assert principal_of(forged) == principal_of(a) == "uid=1000"
    assert node_of(a) == node_of(forged)  # one user, one host: ranks of one job may join each other's runs
    assert tag_of(a) == "pid4242" and tag_of(client_id(address_peer("10.0.0.5"), ())) == "10.0.0.5"
    assert client_id(address_peer(""), ()) == ""  # anonymous: no peer, no claims
    # a loopback address is never an identity: all such peers are one, whatever address they bound
    assert client_id(clientid.UNRESOLVED_LOCAL, ()) == client_id(clientid.UNRESOLVED_LOCAL, ())


def test_process_pid_is_checked_against_the_kernel() -> None:
    me = kernel_peer(1000, 4242, "77", ns_pids=(4242, 7), confirm=lambda claim: claim == "9999")
    assert claim_refusal(me, RES) is None
    assert claim_refusal(me, (("process_pid", "7"),)) is None  # its pid in its own pid namespace
    assert claim_refusal(me, (("process_pid", "9999"),)) is None  # a descendant (confirm)
    why = claim_refusal(me, (("process_pid", "1"),))
    assert why is not None and "not the pushing process" in why and "4242" in why
    assert claim_refusal(me, ()) is None  # no claim: nothing to contradict
    assert claim_refusal(kernel_peer(1000), (("process_pid", "1"),)) is None  # uid only: no pid to check against
    assert claim_refusal(address_peer("10.0.0.5"), (("process_pid", "1"),)) is None
    assert claim_refusal(me.trusted(), (("process_pid", "1"),)) is None  # a forwarder vouches for its clients


def test_trusted_forwarders_vouch_for_their_clients_claims() -> None:
    assert parse_forwarders("uid=998, 10.1.0.0/16,tenant=otel ,10.0.0.7") == (
        "uid=998", "10.1.0.0/16", "tenant=otel", "10.0.0.7/32")
    for bad in ("uid=x", "tenant=", "collector.local"):
        with pytest.raises(ValueError):
            parse_forwarders(bad)
    fwd = parse_forwarders("uid=998,10.1.0.0/16,tenant=otel")
    assert forwarder_matches(kernel_peer(998, 10, "1"), fwd)
    assert forwarder_matches(address_peer("10.1.2.3"), fwd)
    assert forwarder_matches(address_peer("10.0.0.1").with_tenant("otel"), fwd)
    assert not forwarder_matches(kernel_peer(1000, 10, "1"), fwd)
    assert not forwarder_matches(clientid.UNRESOLVED_LOCAL, parse_forwarders("127.0.0.0/8"))
    collector = kernel_peer(998, 10, "1").trusted()
    one = client_id(collector, (("host_name", "n1"), ("process_pid", "101")))
    two = client_id(collector, (("host_name", "n1"), ("process_pid", "102")))
    assert identity_of(one) != identity_of(two)  # each client of the Collector is an identity of its own
    assert identity_of(one).startswith("uid=998") and principal_of(one) == principal_of(two)
    plain = kernel_peer(998, 10, "1")  # the same Collector, not listed: its clients are all its one identity
    assert identity_of(client_id(plain, (("process_pid", "101"),))) == identity_of(client_id(plain, ()))


def test_the_store_bounds_each_identity_and_keeps_series_with_their_principal() -> None:
    from gpu_energy_exporter.otlp.points import Point
    from gpu_energy_exporter.otlp.store import TrainingStore

    store = TrainingStore(max_series=100, max_series_per_client=10)
    a = client_id(kernel_peer(1000, 1, "1"), ())
    b = client_id(kernel_peer(1000, 2, "2"), ())
    c = client_id(kernel_peer(2000, 3, "3"), ())

    def gauge(client: str, i: int, value: float = 1.0) -> Point:
        labels = (("i", str(i)),)
        return Point("gauge", "g", "g", "", labels, "", 0, time.time_ns(), value=value, cost=1000, client=client)

    def apply(points: list[Point]) -> dict[str, int]:
        from gpu_energy_exporter.otlp.points import Batch
        return store.apply(Batch(points=points, received=len(points))).rejected

    assert apply([gauge(a, i) for i in range(30)]) == {"client_series_limit": 20}
    assert apply([gauge(b, 100 + i) for i in range(5)]) == {}  # a's full quota keeps nobody else out
    assert store.series_count() == 15
    assert apply([gauge(b, 0, 2.0)]) == {}  # another process of the same user may write a's series
    assert apply([gauge(c, 0, 3.0)]) == {"not_series_owner": 1}  # another user may not
    text = store.render(False).decode()
    assert 'g{i="0"} 2.0' in text


def test_a_run_id_another_identity_holds_is_scoped_in_the_ledger() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_ledger import T0, Clock, point

    from gpu_energy_exporter.ledger import RunLedger

    ledger = RunLedger(None, warmup_s=0.0, clock=Clock(T0 + 1))
    squatter = client_id(kernel_peer(1000, 1, "1"), ())
    victim = client_id(kernel_peer(1000, 2, "2"), (("host_name", "h"), ("service_instance_id", "v")))
    same_process = client_id(kernel_peer(1000, 1, "1"), (("service_instance_id", "x"),))

    def push(client: str, value: float, rank: str = "0") -> None:
        p = point("job-7", "training_tokens_total", value, T0 + 1, rank=rank)
        p.client = client
        ledger.on_points([p])

    push(squatter, 1)
    for v in (100, 200, 300):
        push(victim, v)
    push(same_process, 9_999)  # another client of the squatter's own process: refused, as before
    assert ledger.run("job-7")["tokens"] == 1  # type: ignore[index]
    assert ledger.run("job-7~pid2")["tokens"] == 300  # type: ignore[index]
    assert ledger._clients.refused["not_run_owner"] == 1


# ----------------------------------------------------------------------------------------------------
# the kernel's view, on real sockets

_CONNECT = ("import socket, sys, time\ns = socket.socket(); s.bind((sys.argv[1], 0)); s.connect(('127.0.0.1', "
            "int(sys.argv[2])))\nprint(s.getsockname()[1], flush=True); time.sleep(30)")


def test_a_loopback_peer_is_the_process_the_socket_table_names_whatever_address_it_bound() -> None:
    resolver = PeerResolver()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        children = [subprocess.Popen([sys.executable, "-c", _CONNECT, source, str(port)], stdout=subprocess.PIPE,
                                     text=True) for source in ("127.0.0.7", "127.0.3.9")]
        try:
            conns = [server.accept() for _ in children]
            by_port = {addr[1]: (conn, addr) for conn, addr in conns}
            for child in children:
                assert child.stdout is not None
                conn, addr = by_port[int(child.stdout.readline())]
                peer = resolver.tcp(addr[0], addr[1], port)
                assert peer.kind == clientid.KERNEL and peer.pid == child.pid
                assert peer.principal == f"uid={os.getuid()}" and str(child.pid) in peer.pids
                assert resolver.known(addr[0], addr[1], port) == peer  # remembered while the process holds it
                conn.close()
            scans = resolver.scans
            assert scans <= 2 * len(children)
        finally:
            for child in children:
                child.kill()
                child.wait()
                if child.stdout is not None:
                    child.stdout.close()
        # the socket gone, its answer is not believed any more
        assert resolver.known(conns[0][1][0], conns[0][1][1], port) is None
    assert resolver.tcp("127.0.0.9", 1, port).kind == clientid.UNRESOLVED  # never the forgeable address
    assert resolver.tcp("192.0.2.7", 1, port) == address_peer("192.0.2.7")


def test_without_the_peers_proc_entries_only_its_user_is_known(tmp_path: Path) -> None:
    """Not root (another user's /proc/<pid>/fd unreadable) or hidepid: the socket table still says whose
    socket it is; every process of that user is then one identity."""
    (tmp_path / "self" / "net").mkdir(parents=True)
    [(_, local)] = [k for k in table_keys("127.0.0.5", 40000) if k[0] == "tcp"]
    line = f"   0: {local} 0100007F:10CE 01 00000000:00000000 00:00000000 00000000  1234        0 999999 1\n"
    (tmp_path / "self" / "net" / "tcp").write_text("  sl  local_address rem_address   st\n" + line)
    (tmp_path / "self" / "net" / "tcp6").write_text("  sl  local_address\n")
    peer = PeerResolver(str(tmp_path)).tcp("127.0.0.5", 40000, 0x10CE)
    assert peer == kernel_peer(1234) and peer.key == "uid=1234" and not peer.pid


def test_a_unix_socket_peer_is_what_so_peercred_says(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen()
        child = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\ns = socket.socket(socket.AF_UNIX)"
                                  "\ns.connect(sys.argv[1]); time.sleep(30)", path])
        try:
            conn, _ = server.accept()
            creds = credentials(conn)
            assert creds is not None and creds[0] == child.pid and creds[1] == os.getuid()
            peer = PeerResolver().unix(creds)
            assert peer.pid == child.pid and peer.kind == clientid.KERNEL
            conn.close()
        finally:
            child.kill()
            child.wait()


# ----------------------------------------------------------------------------------------------------
# end to end


def _attrs(labels: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in labels.items()]


def _tokens_doc(run_id: str, value: float, resource: Mapping[str, str] | None = None, rank: str = "0",
                start_ns: int = 1) -> dict[str, Any]:
    now = time.time_ns()
    rm: dict[str, Any] = {"scopeMetrics": [{"metrics": [{"name": "training.tokens", "unit": "{token}", "sum": {
        "aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [{
            "attributes": _attrs({"run_id": run_id, "rank": rank, "gpu_uuid": "GPU-x"}),
            "startTimeUnixNano": str(start_ns), "timeUnixNano": str(now), "asDouble": value}]}}]}]}
    if resource:
        rm["resource"] = {"attributes": _attrs(resource)}
    return {"resourceMetrics": [rm]}


def _runs(exp: ExporterProcess) -> dict[str, Any]:
    with urllib.request.urlopen(exp.metrics_url + "/api/v1/runs", timeout=10) as r:
        return {run["run_id"]: run for run in json.load(r)["runs"]}


def test_the_otlp_unix_socket_over_http_and_grpc_with_the_helper(start_exporter: type[ExporterProcess],
                                                                 tmp_path: Path) -> None:
    from gpu_energy_exporter.training import start_run

    sock = tmp_path / "run" / "otlp.sock"
    exp = start_exporter([f"--otlp.unix-socket={sock}", "--otlp.grpc.listen-address=127.0.0.1:0",
                          "--collector.interval=200ms", "--runs.warmup=0s"], {}).wait_ready()
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o666
    for protocol in ("http/protobuf", "grpc"):
        env = {"GPU_ENERGY_EXPORTER_OTLP_UNIX_SOCKET": str(sock), "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        run = start_run(f"unix-{protocol[:4]}", gpu_uuids=["GPU-x"], export_interval=0.3, environ=env)
        assert run.endpoint == f"unix:{sock}"
        for _ in range(5):
            run.step(tokens=100)
            time.sleep(0.1)
        run.finish()
        assert run.dropped_exports == 0 and run.rejected_points == 0
    runs = wait_until(lambda: (r := _runs(exp)) and all(
        r.get(f"unix-{p}", {}).get("status") == "finished" for p in ("http", "grpc")) and r, timeout=30,
        what="both runs to finish")
    assert runs["unix-http"]["tokens"] == runs["unix-grpc"]["tokens"] == 500
    # Over the Unix socket the kernel names the process: a process.pid that is not this one is refused.
    [(status, rejected, message)] = neighbour.push(("", 0), [
        {"doc": _tokens_doc("forged", 5, {"process.pid": str(os.getpid())}), "unix": str(sock)}])
    assert (status, rejected) == (200, 1) and "not the pushing process" in message
    exp.stop()
    assert not sock.exists()  # nobody listens on it any more


def test_per_tenant_tokens_make_the_tenant_the_identity_whatever_the_path(start_exporter: type[ExporterProcess],
                                                                          tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# tenant token\nteam-a s3cret-a\nteam-b s3cret-b\n")
    exp = start_exporter([f"--otlp.bearer-token-file={tokens}", "--runs.warmup=0s"], {}).wait_ready()
    a, b = {"Authorization": "Bearer s3cret-a"}, {"Authorization": "Bearer s3cret-b"}
    # one process, two tenants: two identities (the token says who, not the process)
    answers = neighbour.push(exp.address("otlp"), [
        {"doc": _tokens_doc("shared-id", 10), "headers": a},
        {"doc": _tokens_doc("shared-id", 99), "headers": b},
        {"doc": _tokens_doc("shared-id", 20), "headers": a},
        {"doc": _tokens_doc("shared-id", 1), "headers": {"Authorization": "Bearer s3cret-c"}},
    ])
    assert [s for s, _, _ in answers] == [200, 200, 200, 401]
    assert "shared-id~team-b" in answers[1][2]
    runs = wait_until(lambda: (r := _runs(exp)) and "shared-id~team-b" in r and r, timeout=20, what="both runs")
    assert runs["shared-id"]["tokens"] == 20 and runs["shared-id~team-b"]["tokens"] == 99
    for bad, why in (("team-a s3cret\nteam-b s3cret\n", "also 'team-a''s"), ("a b c\n", "'<tenant> <token>'"),
                     ("té s3cret\nx y\n", "may use letters")):
        tokens.write_text(bad)
        from gpu_energy_exporter.otlp.identify import load_bearer_tokens
        with pytest.raises(ConfigError, match=why):
            load_bearer_tokens(str(tokens))
    tokens.write_text("  just-one-token \n")
    assert load_bearer_tokens(str(tokens)) == {"just-one-token": ""}  # the old single-token file


def test_a_trusted_forwarder_vouches_for_its_clients(start_exporter: type[ExporterProcess]) -> None:
    collector = {"service.name": "trainer", "host.name": "node-7"}
    # Not listed: a Collector forwarding its clients' process.pid is refused (its pid is not theirs).
    plain = start_exporter(["--runs.warmup=0s"], {}).wait_ready()
    [(_, rejected, message)] = neighbour.push(plain.address("otlp"), [
        {"doc": _tokens_doc("r", 5, {**collector, "process.pid": "101"})}])
    assert rejected == 1 and "not the pushing process" in message
    # Listed (its user): each client it forwards is an identity of its own; they cannot take each other's ranks.
    trusted = start_exporter(["--runs.warmup=0s", f"--otlp.trusted-forwarders=uid={os.getuid()}"], {}).wait_ready()
    answers = neighbour.push(trusted.address("otlp"), [
        {"doc": _tokens_doc("r", 5, {**collector, "process.pid": "101"})},
        {"doc": _tokens_doc("r", 7, {**collector, "process.pid": "102"})},
    ])
    assert [n for _, n, _ in answers] == [0, 0] and "belongs to another identity" in answers[1][2]
    runs = wait_until(lambda: (r := _runs(trusted)) and len(r) == 2 and r, timeout=20, what="two runs")
    assert runs["r"]["tokens"] == 5 and sum(run["tokens"] for run in runs.values()) == 12


HTTP_RANKS, GRPC_RANKS, ROUNDS = 200, 50, 4


def test_200_ranks_over_http_and_50_over_grpc_lose_no_token(start_exporter: type[ExporterProcess]) -> None:
    """Helper-like ranks (each its own resource: host, pid, instance id) of 10 runs, pushing cumulative totals
    at once over HTTP and gRPC: every token reaches /metrics and the ledger."""
    import grpc
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as pb

    exp = start_exporter(["--otlp.grpc.listen-address=127.0.0.1:0", "--runs.warmup=0s"], {}).wait_ready()
    ranks = [(f"load-{r % 10}", str(r), "grpc" if r >= HTTP_RANKS else "http") for r in range(HTTP_RANKS + GRPC_RANKS)]
    start = time.time_ns()
    # one channel per gRPC rank, as each trainer has its own exporter
    channels = {r: grpc.insecure_channel(exp.grpc_endpoint.removeprefix("http://"),
                                         options=[("grpc.use_local_subchannel_pool", 1)])
                for _, r, via in ranks if via == "grpc"}
    exports = {r: c.unary_unary("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
                                request_serializer=pb.ExportMetricsServiceRequest.SerializeToString,
                                response_deserializer=pb.ExportMetricsServiceResponse.FromString)
               for r, c in channels.items()}
    host, port = exp.address("otlp")
    local = threading.local()
    opened: list[Any] = []

    def push(rank: tuple[str, str, str], value: float) -> None:
        run_id, r, via = rank
        resource = {"service.name": "t", "host.name": "node", "process.pid": str(os.getpid()),
                    "service.instance.id": f"rank-{r}"}
        doc = _tokens_doc(run_id, value, resource, rank=r, start_ns=start)
        message = json_format.ParseDict(doc, pb.ExportMetricsServiceRequest())
        if via == "grpc":
            answer = exports[r](message, timeout=30, wait_for_ready=True)
        else:
            import http.client
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection(host, port, timeout=30)
                opened.append(conn)
            conn.request("POST", "/v1/metrics", message.SerializeToString(),
                         {"Content-Type": "application/x-protobuf"})
            response = conn.getresponse()
            assert response.status == 200
            answer = pb.ExportMetricsServiceResponse.FromString(response.read())
        assert answer.partial_success.rejected_data_points == 0, answer.partial_success.error_message

    with ThreadPoolExecutor(16) as pool:
        for n in range(1, ROUNDS + 1):
            list(pool.map(lambda rank, n=n: push(rank, 100.0 * n), ranks))
    for channel in channels.values():
        channel.close()
    for conn in opened:
        conn.close()
    total = 100.0 * ROUNDS * len(ranks)
    exposed = sum(v for labels, v in samples(exp.metrics(), "training_tokens_total")
                  if labels["run_id"].startswith("load-"))
    assert exposed == total
    runs = wait_until(lambda: (r := _runs(exp)) and sum(
        run["tokens"] or 0 for k, run in r.items() if k.startswith("load-")) == total and r, timeout=20,
        what="the ledger to count every token")
    assert sorted(k for k in runs if k.startswith("load-")) == [f"load-{i}" for i in range(10)]
    assert sample_value(exp.metrics(), "gpuenergy_otlp_run_id_collisions_total") == 0
