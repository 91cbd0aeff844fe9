"""Issue 29, item 1 on Kubernetes: a push from a pod's address is that pod, and a pod may report only its GPUs.

- the rules on plain values: which pods of an API server's ``PodList`` hold an address (``kubernetes.podips``),
  when the directory asks the API again, a pod's identity (``core.clientid.pod_peer``), the GPU check
  (``otlp.podgpus``);
- end to end: the exporter (fake NVML, the real pod-resources client against the stand-in kubelet) with a
  stand-in API server; a neighbour process pushes from this machine's own non-loopback address, which the
  exporter's kernel view cannot name (``--path.procfs`` is empty, as the node's /proc is for a process in a pod's
  network namespace), so only the pod list says who it is.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import neighbour
import pytest
from fakenvml import Constant, Scenario, h100
from helpers import ExporterProcess, sample_value, wait_until

from gpu_energy_exporter.collectors.kubernetes.podips import PodDirectory, pods_by_address
from gpu_energy_exporter.collectors.kubernetes.testing import FakeKubelet, fake_pod
from gpu_energy_exporter.core.clientid import POD, client_id, identity_of, principal_of, tag_of
from gpu_energy_exporter.core.contract import ATTR_GPU_UUID
from gpu_energy_exporter.otlp.podgpus import FOREIGN_GPU, restrict_to_pod
from gpu_energy_exporter.otlp.points import Batch, Point


def _pod(ns: str, name: str, uid: str, ip: str | None, *, phase: str = "Running", host_network: bool = False,
         ips: tuple[str, ...] = ()) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    if ips:
        status["podIPs"] = [{"ip": i} for i in ips]
    return {"metadata": {"namespace": ns, "name": name, "uid": uid}, "spec": {"hostNetwork": host_network},
            "status": status}


# ----------------------------------------------------------------------------------------------------
# the rules


def test_only_pods_that_hold_their_own_address_are_listed() -> None:
    doc = {"kind": "PodList", "items": [
        _pod("ml", "train-0", "u-1", "10.1.0.5", ips=("10.1.0.5", "fd00:1::5")),
        _pod("kube-system", "exporter", "u-2", "192.0.2.10", host_network=True),  # the node's address
        _pod("ml", "done", "u-3", "10.1.0.6", phase="Succeeded"),  # gave its address back
        _pod("ml", "failed", "u-4", "10.1.0.7", phase="Failed"),
        _pod("ml", "pending", "u-5", None),  # no address yet
        {"metadata": {"namespace": "ml", "name": "no-uid"}, "status": {"podIP": "10.1.0.8"}},
        "junk", {"metadata": "junk"},
    ]}
    got = pods_by_address(doc)
    assert sorted(got) == ["10.1.0.5", "fd00:1::5"]
    pod = got["10.1.0.5"]
    assert pod.kind == POD and pod.pod == ("ml", "train-0", "u-1") and got["fd00:1::5"] == pod
    assert pods_by_address({"items": "junk"}) == {} and pods_by_address({}) == {}


def test_a_pod_is_its_uid_under_its_namespace() -> None:
    a = pods_by_address({"items": [_pod("ml", "train-0", "uid-a", "10.1.0.5")]})["10.1.0.5"]
    b = pods_by_address({"items": [_pod("ml", "train-0", "uid-b", "10.1.0.5")]})["10.1.0.5"]
    c = pods_by_address({"items": [_pod("ml", "train-1", "uid-c", "10.1.0.9")]})["10.1.0.9"]
    res = (("host_name", "train-0"), ("process_pid", "1"))
    # the same address and name after the pod was recreated: another identity
    assert identity_of(client_id(a, res)) != identity_of(client_id(b, res))
    # two pods of one namespace share the principal (the ranks of one job on this node may join one run)
    assert principal_of(client_id(a, res)) == principal_of(client_id(c, res)) == "ns=ml"
    # a scoped run id names the pod and its uid: a pod's name alone is predictable (StatefulSets, Jobs)
    assert tag_of(client_id(a, res)) == a.tag == "ml.train-0.uid-a"
    # a per-tenant token makes the tenant the identity, and the pod's GPUs still bind its points
    tenant = a.with_tenant("team-a")
    assert tenant.key == "tenant=team-a" and tenant.pod == ("ml", "train-0", "uid-a")


def test_a_collector_pod_listed_by_address_still_vouches_and_tokens_still_name_the_tenant() -> None:
    from gpu_energy_exporter.core.clientid import address_peer, parse_forwarders
    from gpu_energy_exporter.otlp.identify import Identities

    pods = pods_by_address({"items": [_pod("obs", "collector", "u-c", "10.1.0.5"),
                                      _pod("ml", "train-0", "u-t", "10.1.0.6")]})
    ids = Identities(tokens={"s3cret": "team-a"}, forwarders=parse_forwarders("10.1.0.5"), pods=pods.get)
    collector = ids.identify(address_peer("10.1.0.5"), "")
    assert collector.kind == POD and collector.pod == ("obs", "collector", "u-c") and collector.vouches
    trainer = ids.identify(address_peer("10.1.0.6"), "")
    assert trainer.kind == POD and not trainer.vouches
    tenant = ids.identify(address_peer("10.1.0.6"), "Bearer s3cret")
    assert tenant.key == "tenant=team-a" and tenant.pod == ("ml", "train-0", "u-t")
    off_node = ids.identify(address_peer("10.9.9.9"), "")
    assert off_node.key == "ip=10.9.9.9" and off_node.pod is None


class _Api:
    """A fetch that answers a list (or raises) and counts the calls."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.calls = 0
        self.fail = False

    def __call__(self) -> bytes:
        self.calls += 1
        if self.fail:
            raise OSError("connection refused")
        return json.dumps({"items": self.items}).encode()


def test_the_directory_asks_again_when_stale_or_for_a_new_address_at_most_once_a_second() -> None:
    now = [100.0]
    api = _Api([_pod("ml", "a", "u-a", "10.1.0.5")])
    d = PodDirectory(api, refresh_s=10.0, clock=lambda: now[0])
    assert d.pod_of("10.1.0.5") is not None and api.calls == 1
    assert d.pod_of("::ffff:10.1.0.5") is not None and api.calls == 1  # the IPv4-mapped form: the same pod
    # an address no pod holds: asked again, but at most once a second (a flood of unknown peers is one call)
    now[0] += 1.5
    for _ in range(50):
        assert d.pod_of("10.9.9.9") is None
    assert api.calls == 2
    # a pod that just started is found at the next miss a second later
    api.items.append(_pod("ml", "b", "u-b", "10.1.0.6"))
    assert d.pod_of("10.1.0.6") is None and api.calls == 2
    now[0] += 1.0
    b = d.pod_of("10.1.0.6")
    assert b is not None and b.pod == ("ml", "b", "u-b") and api.calls == 3
    # a stale list is fetched again at the next look-up; a failed fetch keeps the last list
    now[0] += 11.0
    api.fail = True
    assert d.pod_of("10.1.0.5") is not None and api.calls == 4 and not d.available and "refused" in d.error
    now[0] += 11.0
    api.fail = False
    api.items = [_pod("ml", "a2", "u-a2", "10.1.0.5")]  # the address now belongs to another pod
    again = d.pod_of("10.1.0.5")
    assert again is not None and again.pod == ("ml", "a2", "u-a2") and d.available


def test_a_missed_address_is_asked_once_per_refresh_a_refusal_waits_and_no_failure_reaches_the_push() -> None:
    import http.client

    now = [100.0]
    api = _Api([_pod("ml", "a", "u-a", "10.1.0.5")])
    d = PodDirectory(api, refresh_s=10.0, clock=lambda: now[0])
    assert d.pod_of("10.9.9.9") is None and api.calls == 1
    for _ in range(8):  # a host off the node pushing every second: one fetch per refresh interval, not one a second
        now[0] += 1.0
        assert d.pod_of("10.9.9.9") is None
    assert api.calls == 1
    now[0] += 2.5
    assert d.pod_of("10.9.9.9") is None and api.calls == 2
    # the forms one address takes are one key
    api.items = [_pod("ml", "v6", "u-6", "FD00:0:0:0::7")]
    now[0] += 11.0
    assert d.pod_of("fd00::7") is not None and d.pod_of("fd00:0::7%eth0") is not None
    # a stale list is refreshed by one push; the others are answered from it meanwhile, without waiting
    now[0] += 11.0
    with d._lock:  # another thread is fetching
        assert d.pod_of("fd00::7") is not None
    calls = api.calls
    # whatever the fetch raises is the directory's failure, never the push's
    for exc in (http.client.BadStatusLine("\x15\x03"), RecursionError("nested"), KeyError("x")):
        def broken(exc: BaseException = exc) -> bytes:
            raise exc
        d._fetch = broken
        now[0] += 11.0
        assert d.pod_of("fd00::7") is not None and not d.available  # the last list stays in use
    assert d.failures == 3 and calls == api.calls

    # 401/403: the RBAC will not fix itself in a second, asked again after 5 minutes
    import urllib.error
    forbidden = [0]

    def refused() -> bytes:
        forbidden[0] += 1
        raise urllib.error.HTTPError("https://api/api/v1/pods", 403, "Forbidden", {}, None)  # type: ignore[arg-type]
    d2 = PodDirectory(refused, refresh_s=10.0, clock=lambda: now[0])
    for _ in range(30):
        now[0] += 2.0
        assert d2.pod_of("10.1.0.5") is None
    assert forbidden[0] == 1 and "needs 'list' on pods" in d2.error
    now[0] += 300.0
    d2.pod_of("10.1.0.5")
    assert forbidden[0] == 2


def test_a_pods_resource_is_its_own_pod_so_its_pid_names_only_its_processes() -> None:
    from gpu_energy_exporter.core.contract import LABEL_POD_UID
    from gpu_energy_exporter.core.procinfo import ProcessIdentity
    from gpu_energy_exporter.otlp.translate import translate_request

    pod = pods_by_address({"items": [_pod("evil", "x", "uid-evil", "10.1.0.9")]})["10.1.0.9"]
    doc = _tokens("r", 5, "GPU-a")
    doc["resourceMetrics"][0]["resource"] = {"attributes": [
        {"key": "process.pid", "value": {"stringValue": "1"}},
        {"key": "k8s.pod.uid", "value": {"stringValue": "uid-victim"}}]}
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    batch = translate_request(json_format.ParseDict(doc, ExportMetricsServiceRequest()), time.time_ns(), peer=pod)
    [p] = batch.points
    assert dict(p.resource)[LABEL_POD_UID] == "uid-evil"  # what it claimed is replaced by what it is
    victim = ProcessIdentity(pid=5000, ns_pids=(5000, 1), container_id="", pod_uid="uid-victim")
    assert not victim.matches(1, "", "uid-evil") and not victim.matches(5000, "", "uid-evil")
    assert victim.matches(1, "", "uid-victim")  # the victim's own claim still finds it


def test_a_pod_the_kubelet_lists_without_a_gpu_may_name_none(tmp_path: Path) -> None:
    from test_kubernetes_collector import G0, States

    from gpu_energy_exporter.collectors.kubernetes.collector import KubernetesCollector
    from gpu_energy_exporter.daemon.config import load_config

    sock = str(tmp_path / "kubelet.sock")
    cfg = load_config(["--collector.kubernetes", "--kubernetes.pod-resources-socket", sock,
                       "--kubernetes.refresh-interval", "1h"], {})
    collector = KubernetesCollector.from_config(cfg, States())
    with FakeKubelet(sock) as kubelet:
        kubelet.set_pods([fake_pod("ml", "gpu", {"c": [G0]}), fake_pod("ml", "cpu-only", {"c": []})])
        try:
            assert collector.devices_of("ml", "gpu") is None  # no answer yet
            wait_until(lambda: (collector.update(), collector.devices_of("ml", "gpu"))[1] is not None, timeout=10,
                       what="the kubelet's answer")
        finally:
            collector.close()
    assert collector.devices_of("ml", "gpu") == frozenset({G0.lower()[4:]})
    assert collector.devices_of("ml", "cpu-only") == frozenset()  # listed, no GPU: may name none
    assert collector.devices_of("ml", "started-since") is None  # not listed yet: not restricted
    pod = pods_by_address({"items": [_pod("ml", "cpu-only", "u-c", "10.1.0.5")]})["10.1.0.5"]
    batch = Batch(points=[_point(G0)], received=1)
    restrict_to_pod(batch, pod, collector.devices_of)
    assert batch.points == [] and batch.rejected == {FOREIGN_GPU: 1}


def _point(gpu: str) -> Point:
    labels = (("rank", "0"), ("run_id", "r")) + (((ATTR_GPU_UUID, gpu),) if gpu else ())
    return Point("counter", "training_tokens_total", "", "", tuple(sorted(labels)), "r", 1, 2, value=1.0)


@pytest.mark.parametrize(("gpu", "held", "kept"), [
    ("GPU-AAAA", frozenset({"aaaa"}), True),  # its own GPU (any case, with or without the GPU- prefix)
    ("aaaa", frozenset({"aaaa"}), True),
    ("GPU-BBBB", frozenset({"aaaa"}), False),  # a neighbour's GPU
    ("GPU-AAAA,GPU-BBBB", frozenset({"aaaa"}), False),  # one foreign GPU among its own
    ("MIG-1111", frozenset({"aaaa", "mig-1111"}), True),  # its MIG instance
    ("none", frozenset({"aaaa"}), True),  # names no GPU
    ("", frozenset({"aaaa"}), True),
    ("GPU-BBBB", None, True),  # the kubelet has not listed the pod yet: not restricted here
])
def test_a_pods_points_may_name_only_its_gpus(gpu: str, held: frozenset[str] | None, kept: bool) -> None:
    pod = pods_by_address({"items": [_pod("ml", "a", "u-a", "10.1.0.5")]})["10.1.0.5"]
    batch = Batch(points=[_point(gpu)], received=1)
    restrict_to_pod(batch, pod, lambda ns, name: held if (ns, name) == ("ml", "a") else frozenset())
    assert (len(batch.points) == 1) == kept
    assert batch.rejected == ({} if kept else {FOREIGN_GPU: 1})
    if not kept:
        assert "pod ml/a" in batch.messages[FOREIGN_GPU]


# ----------------------------------------------------------------------------------------------------
# end to end


def _own_address() -> str | None:
    """A non-loopback IPv4 address of this machine (it stands in for a pod's address), or None."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError:
            continue
        finally:
            s.close()
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return address
    return None


class _ApiServer:
    """A stand-in Kubernetes API server: ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`` answers the
    pods set on it (only with that selector, as the real one filters)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.items: list[dict[str, Any]] = []
        self.calls = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                owner.calls += 1
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                if url.path != "/api/v1/pods" or query.get("fieldSelector") != [f"spec.nodeName={owner.node}"]:
                    self.send_error(400, "want this node's pods")
                    return
                body = json.dumps({"kind": "PodList", "items": owner.items}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def node(fake_nvml_lib: Path, tmp_path: Path, start_exporter: type[ExporterProcess]) -> Iterator[dict[str, Any]]:
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to stand in for a pod's address")
    gpus = [h100(0, power=Constant(300.0)), h100(1, power=Constant(300.0))]
    scenario = tmp_path / "scenario.ini"
    Scenario(epoch=time.time(), gpus=gpus).write(scenario)
    api = _ApiServer("node-a")
    api.items = [_pod("ml", "train-0", "uid-1", address)]
    sock = str(tmp_path / "kubelet.sock")
    procfs = tmp_path / "proc"  # the node's /proc as seen for a pod's connection: its socket is not there
    procfs.mkdir()
    with FakeKubelet(sock) as kubelet:
        kubelet.set_pods([fake_pod("ml", "train-0", {"trainer": [gpus[0].uuid]}),
                          fake_pod("ml", "other", {"trainer": [gpus[1].uuid]})])
        exp = start_exporter([
            f"--nvml.library={fake_nvml_lib}", "--collector.kubernetes", f"--kubernetes.pod-resources-socket={sock}",
            "--kubernetes.refresh-interval=1s", f"--kubernetes.api-url={api.url}", "--kubernetes.node-name=node-a",
            f"--path.procfs={procfs}", f"--otlp.listen-address={address}:0", "--runs.warmup=0s",
            "--no-collector.host", "--no-collector.rapl"],
            {"FAKE_NVML_SCENARIO": str(scenario)}).wait_ready()
        try:
            # the kubelet's first answer is in (its pods' series): a pod's GPUs are known from then on
            wait_until(lambda: 'k8s_pod="train-0"' in exp.metrics(), timeout=30, what="the pod-resources answer")
            yield {"exp": exp, "api": api, "address": address, "gpus": [g.uuid for g in gpus]}
        finally:
            exp.stop()
            api.close()


def _tokens(run_id: str, value: float, gpu: str) -> dict[str, Any]:
    attrs = {"run_id": run_id, "rank": "0", "gpu_uuid": gpu}
    return {"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "training.tokens", "unit": "{token}", "sum": {
        "aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [{
            "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()],
            "startTimeUnixNano": "1", "timeUnixNano": str(time.time_ns()), "asDouble": value}]}}]}]}]}


def _run(exp: ExporterProcess, run_id: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(exp.metrics_url + "/api/v1/run?id=" + urllib.parse.quote(run_id), timeout=10) as r:
            doc: dict[str, Any] = json.load(r)
            return doc
    except urllib.error.HTTPError:
        return None


def test_a_push_from_a_pods_address_is_that_pod_and_names_only_its_gpus(node: dict[str, Any]) -> None:
    exp, api, address, (mine, theirs) = node["exp"], node["api"], node["address"], node["gpus"]
    otlp = exp.address("otlp")
    push = [{"doc": _tokens("pod-run", 100, mine), "source": address},
            {"doc": _tokens("pod-run", 150, theirs), "source": address},  # the other pod's GPU
            {"doc": _tokens("pod-run", 200, mine), "source": address}]
    answers = neighbour.push(otlp, push)
    assert [(s, n) for s, n, _ in answers] == [(200, 0), (200, 1), (200, 0)], answers
    assert "not one of the GPUs the kubelet gave pod ml/train-0" in answers[1][2]
    run = wait_until(lambda: (r := _run(exp, "pod-run")) and r.get("tokens") == 200 and r, timeout=20,
                     what="the pod's run with its own tokens")
    assert run["tokens"] == 200  # the refused point (150, on the other pod's GPU) never counted
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_otlp_points_rejected_total", reason="foreign_gpu") == 1.0
    assert api.calls >= 1

    # The pod is deleted and a new pod gets its address: another identity, which cannot add to the old run;
    # its push under the same run id is stored under its own scoped run id.
    api.items = [_pod("ml", "train-0", "uid-2", address)]
    time.sleep(1.2)  # the directory's list is older than --kubernetes.refresh-interval (1s): asked again
    [(status, rejected, message)] = neighbour.push(otlp, [{"doc": _tokens("pod-run", 999, mine), "source": address}])
    assert (status, rejected) == (200, 0) and "pod-run~ml.train-0.uid-2" in message, message
    wait_until(lambda: (r := _run(exp, "pod-run~ml.train-0.uid-2")) and r.get("tokens") == 999, timeout=20,
               what="the new pod's scoped run")
    assert (_run(exp, "pod-run") or {}).get("tokens") == 200
