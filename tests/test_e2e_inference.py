"""End to end for inference: the exporter on the fake NVML library with the kubelet stand-in (so it has pod
energy series), a stand-in server per engine and pod (tests/inference_servers.py), and a real Prometheus
scraping both with the scrape job of docs/inference.md and the bundled rules loaded; the J/token, J/1k
tokens, tokens/kWh, CO2 and idle figures the rules record, read through Prometheus's HTTP API, within 1% of
the values worked out by hand from the fake's exact power and the servers' exact token rates.

For each of vLLM, SGLang, TGI and Triton: a pod over two GPUs (tensor parallel), a pod on a GPU time-sliced
with a training pod (the exporter splits it by SM use, 3/4 to the server), and an idle pod (it served a few
tokens at start, none since). Beside them, servers Prometheus must refuse without harm: one that never
answers, one that floods its /metrics, one with a runaway label value, one that sends garbage.

Two choices keep a one-minute test exact to 1%, both stated here:
- Pod energy is settled at each energy-counter read, every 3 s here (``--collector.energy-interval=3s``,
  six power samples per read, scrapes every 1 s): the settled counter alone lags by up to 3 s and a 60 s
  window holds 57 or 60 s of it, 2-5% off; the rules add the provisional gauge, so they are not
  (docs/inference.md, "Which pod energy").
- The rules are loaded with their 5-minute windows narrowed to 60 s (a text substitution of ``[5m]`` and of
  the window's ``/ 300`` seconds in the shipped files: the expressions are the shipped ones), so the check
  can run after 70 s of scraping instead of 5 minutes. The promtool cases (dashboards/tests/inference_test.yaml)
  check the 5-minute rules as shipped.
"""

from __future__ import annotations

import re
import shutil
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakenvml import Constant, Process, Scenario, h100
from helpers import ROOT, ExporterProcess, sample_value, wait_until
from inference_servers import SERVERS, Hostile, Segment, StandInServer, Trace, TritonServer
from prom import Prometheus

pytest.importorskip("grpc")

from gpu_energy_exporter.collectors.kubernetes.testing import FakeKubelet, fake_pod  # noqa: E402

pytestmark = pytest.mark.slow

WINDOW_S = 60
ENGINES = ("vllm", "sglang", "tgi", "triton")
GIB = 1 << 30
#: The fake GPUs' exact power (W): a tensor-parallel pod's two GPUs, a shared GPU, an idle one.
TP2_W = (300.0, 340.0)
SHARED_W = 512.0
SERVER_SM, TRAINER_SM = 75, 25  # SM % of the serving and the training process on the shared GPU
IDLE_W = 96.0
#: Grid intensity x PUE (g/kWh), from the exporter's flags.
INTENSITY, PUE = 400.0, 1.2
G_PER_J = INTENSITY * PUE / 3.6e6
#: The servers' exact load (tokens and requests per second).
TP2_LOAD = dict(prompt=5120.0, output=1280.0, requests=10.0)
SHARED_LOAD = dict(prompt=1536.0, output=512.0, requests=4.0)
MODELS = {"tp2": "llama-3-70b", "shared": "llama-3-8b", "idle": "llama-3-8b"}

# The hand values (the rules must match them within 1%).
TP2_POWER = sum(TP2_W)                                      # 640 W: the pod sums its two GPUs
SHARED_POWER = SHARED_W * SERVER_SM / (SERVER_SM + TRAINER_SM)  # 384 W: its SM share of the GPU
EXPECTED_POD = {
    "tp2": {"j_per_output_token": TP2_POWER / TP2_LOAD["output"],                                   # 0.5
            "j_per_1k_tokens": 1000 * TP2_POWER / (TP2_LOAD["prompt"] + TP2_LOAD["output"]),        # 100
            "tokens_per_kwh": (TP2_LOAD["prompt"] + TP2_LOAD["output"]) * 3.6e6 / TP2_POWER,        # 3.6e7
            "co2_per_1k_tokens": 1000 * TP2_POWER * G_PER_J / (TP2_LOAD["prompt"] + TP2_LOAD["output"]),
            "j_per_request": TP2_POWER / TP2_LOAD["requests"]},                                     # 64
    "shared": {"j_per_output_token": SHARED_POWER / SHARED_LOAD["output"],                          # 0.75
               "j_per_1k_tokens": 1000 * SHARED_POWER / (SHARED_LOAD["prompt"] + SHARED_LOAD["output"]),
               "tokens_per_kwh": (SHARED_LOAD["prompt"] + SHARED_LOAD["output"]) * 3.6e6 / SHARED_POWER,
               "co2_per_1k_tokens": 1000 * SHARED_POWER * G_PER_J / (SHARED_LOAD["prompt"] + SHARED_LOAD["output"]),
               "j_per_request": SHARED_POWER / SHARED_LOAD["requests"]},
}
RULES = {"j_per_output_token": "namespace_pod:inference_energy_joules_per_output_token:ratio_rate5m",
         "j_per_1k_tokens": "namespace_pod:inference_energy_joules_per_1k_tokens:ratio_rate5m",
         "tokens_per_kwh": "namespace_pod:inference_tokens_per_kwh:ratio_rate5m",
         "co2_per_1k_tokens": "namespace_pod:inference_co2_grams_per_1k_tokens:ratio_rate5m",
         "j_per_request": "namespace_pod:inference_energy_joules_per_request:ratio_rate5m"}
#: The idle pod's window: all idle energy, no ratio.
IDLE_J = IDLE_W * WINDOW_S
#: llama-3-8b per engine: the shared and the idle pod together (TGI's idle pod names no model: alone).
MODEL_8B_J_PER_OUTPUT_TOKEN = (SHARED_POWER + IDLE_W) / SHARED_LOAD["output"]  # 0.9375


def _docs_scrape_job() -> dict[str, Any]:
    """The inference-servers job exactly as docs/inference.md shows it."""
    text = (ROOT / "docs" / "inference.md").read_text(encoding="utf-8")
    for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL):
        if "job_name: inference-servers" in block:
            (job,) = yaml.safe_load(block)["scrape_configs"]
            return dict(job)
    raise AssertionError("docs/inference.md shows no inference-servers scrape job")


def _rules(tmp: Path) -> list[Path]:
    """The shipped recording rules with every 5-minute window narrowed to WINDOW_S."""
    out = []
    narrowed = f"[{WINDOW_S}s]"
    for name in ("recording.yaml", "inference.yaml"):
        text = (ROOT / "dashboards" / "rules" / name).read_text(encoding="utf-8")
        assert "[5m]" in text and narrowed not in text  # so the copy differs from the file in its windows only
        text = text.replace("[5m]", narrowed)
        if name == "inference.yaml":  # the pod's power: its energy over the window's seconds
            assert text.count(":increase5m / 300\n") == 1
            text = text.replace(":increase5m / 300\n", f":increase5m / {WINDOW_S}\n")
        path = tmp / name
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return out


def _host_proc(root: Path, pid: int, pod: str) -> None:
    """``<root>/<pid>``: a process of ``pod``'s container as the host's /proc shows it (the exporter reads the
    pod's name from HOSTNAME to split a shared GPU by SM use)."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\tpython\nPid:\t{pid}\nNSpid:\t{pid}\t7\n")
    uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, pod)).replace("-", "_")
    (d / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
                              f"cri-containerd-{pid:064x}.scope\n")
    (d / "environ").write_bytes(f"PATH=/usr/bin\0HOSTNAME={pod}\0".encode())


@dataclass
class Target:
    namespace: str
    pod: str
    server: StandInServer
    pod_labels: dict[str, str]


@dataclass
class Session:
    prom: Prometheus
    exporter: ExporterProcess
    targets: list[Target]

    def one(self, expr: str) -> float | None:
        return self.prom.value(expr)


def _static_config(t: Target) -> dict[str, Any]:
    """The labels Kubernetes service discovery would give the pod's target."""
    host, port = t.server.target.split(":")
    labels = {"__meta_kubernetes_namespace": t.namespace, "__meta_kubernetes_pod_name": t.pod,
              "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
              "__meta_kubernetes_pod_annotation_prometheus_io_port": port,
              **{f"__meta_kubernetes_pod_label_{k}": v for k, v in t.pod_labels.items()}}
    return {"targets": [f"{host}:8000"], "labels": labels}  # the port comes from the annotation


def _servers() -> list[Target]:
    """The stand-in servers, not started: per engine a tensor-parallel, a shared and an idle pod's; then the
    ones Prometheus must refuse, each alone: no answer, a flood of series, a runaway label, garbage."""
    targets = []
    for eng in ENGINES:
        tgi = {"app_kubernetes_io_name": "text-generation-inference"} if eng == "tgi" else {}
        for role, trace in (("tp2", Trace.constant(**TP2_LOAD)), ("shared", Trace.constant(**SHARED_LOAD)),
                            ("idle", Trace([Segment(2.0, 768.0, 256.0, 2.0)]))):
            model = MODELS[role]
            server = (TritonServer(model, trace, backend="vllm") if eng == "triton" and role == "idle"
                      else SERVERS[eng](model, trace))
            labels = {**tgi, "model": model} if eng == "tgi" and role != "idle" else dict(tgi)
            if eng == "triton":
                labels["model"] = "not-the-model"  # a pod label must never replace Triton's own model label
            targets.append(Target("serve", f"{eng}-{role}", server, labels))
    bad = {pod: SERVERS[pod.split("-")[0]]("llama-3-8b", Trace.constant(**SHARED_LOAD))
           for pod in ("vllm-hung", "sglang-flood", "triton-runaway", "tgi-garbage")}
    bad["vllm-hung"].hang = True
    bad["sglang-flood"].hostile = Hostile.many_series(30_000)
    bad["triton-runaway"].hostile = Hostile.huge_label(4096)
    bad["tgi-garbage"].hostile = Hostile.garbage(4096)
    return targets + [Target("serve", pod, server, {}) for pod, server in bad.items()]


@pytest.fixture(scope="module")
def session(fake_nvml_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    tmp = tmp_path_factory.mktemp("e2e-inference")
    gpus, pods = [], []
    procfs = tmp / "proc"
    shutil.copytree(ROOT / "tests" / "fixtures" / "procfs-host", procfs)
    for i, eng in enumerate(ENGINES):
        base = 4 * i
        serving, training = 5000 + i, 6000 + i
        gpus += [h100(base, power=Constant(TP2_W[0])), h100(base + 1, power=Constant(TP2_W[1])),
                 h100(base + 2, power=Constant(SHARED_W),
                      processes=(Process(serving, GIB, SERVER_SM), Process(training, GIB, TRAINER_SM))),
                 h100(base + 3, power=Constant(IDLE_W))]
        _host_proc(procfs, serving, f"{eng}-shared")
        _host_proc(procfs, training, f"train-{eng}")
        pods += [fake_pod("serve", f"{eng}-tp2", {eng: [gpus[base].uuid, gpus[base + 1].uuid]}),
                 fake_pod("serve", f"{eng}-shared", {eng: [("nvidia.com/gpu", gpus[base + 2].uuid + "::0")]}),
                 fake_pod("ml", f"train-{eng}", {"trainer": [("nvidia.com/gpu", gpus[base + 2].uuid + "::1")]}),
                 fake_pod("serve", f"{eng}-idle", {eng: [gpus[base + 3].uuid]})]
    Scenario(epoch=time.time() - 3600, gpus=gpus).write(tmp / "scenario.ini")
    sock = str(tmp / "kubelet.sock")
    targets = _servers()
    kubelet = FakeKubelet(sock)
    exporter = prom = None
    try:
        for t in targets:
            t.server.start()
        kubelet.start().set_pods(pods)
        exporter = ExporterProcess(
            [f"--nvml.library={fake_nvml_lib}", "--collector.interval=0.5s", "--collector.energy-interval=3s",
             "--collector.kubernetes", f"--kubernetes.pod-resources-socket={sock}",
             "--kubernetes.refresh-interval=1s", f"--path.procfs={procfs}", "--collector.gpu.process-interval=1s",
             f"--carbon.intensity={INTENSITY}", f"--carbon.pue={PUE}"],
            {"FAKE_NVML_SCENARIO": str(tmp / "scenario.ini")},
        ).wait_ready()
        job = _docs_scrape_job()
        del job["kubernetes_sd_configs"]
        job.update(scrape_interval="1s", scrape_timeout="1s",
                   static_configs=[_static_config(t) for t in targets])
        # The exporter's own pod labels, as a ServiceMonitor would give its series: the rules must key on
        # k8s_namespace / k8s_pod, never on these.
        prom = Prometheus(tmp / "prom", [urllib.parse.urlparse(exporter.metrics_url).netloc],
                          rule_files=_rules(tmp), scrape_configs=[job],
                          target_labels={"namespace": "gpu-energy-exporter", "pod": "gpu-energy-exporter-5d8kq"})
        running = prom
        wait_until(lambda: running.value('count(up{job="inference-servers"} == 1)') == 12.0, timeout=30,
                   what="the twelve good servers scraped")
        # The shared GPUs split by SM use (not evenly, as before the first utilisation read) before the window.
        scraped = exporter
        wait_until(lambda: all(sample_value(_scrape(scraped), "gpuenergy_k8s_pod_energy_joules_total",
                                            k8s_pod=f"{eng}-shared", method="sm_utilization")
                               for eng in ENGINES), timeout=30, what="the shared GPUs split by SM use")
        time.sleep(WINDOW_S + 8)
        yield Session(prom, exporter, targets)
    finally:
        if prom is not None:
            prom.stop()
        if exporter is not None:
            exporter.stop()
        kubelet.stop()
        for t in targets:
            t.server.stop()


def _scrape(exporter: ExporterProcess) -> str:
    with urllib.request.urlopen(exporter.scrape_url, timeout=10) as r:
        return str(r.read().decode())


def _report(what: str, got: float, expected: float) -> None:
    print(f"\n[inference e2e] {what}: {got:.6g}, hand value {expected:.6g}, error {100 * (got / expected - 1):+.3f}%")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("role", ["tp2", "shared"])
def test_rules_match_the_hand_values(session: Session, engine: str, role: str) -> None:
    for figure, rule in RULES.items():
        got = session.one(f'{rule}{{namespace="serve", pod="{engine}-{role}"}}')
        expected = EXPECTED_POD[role][figure]
        assert got is not None, f"{rule} has no value for {engine}-{role}"
        _report(f"{engine}-{role} {figure}", got, expected)
        assert got == pytest.approx(expected, rel=0.01), (figure, got, expected)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_idle_pod_shows_idle_energy_and_no_ratio(session: Session, engine: str) -> None:
    pod = f'namespace="serve", pod="{engine}-idle"'
    got = session.one(f"namespace_pod:inference_idle_energy_joules:increase5m{{{pod}}}")
    assert got is not None
    _report(f"{engine}-idle idle energy", got, IDLE_J)
    assert got == pytest.approx(IDLE_J, rel=0.01)
    for figure in ("j_per_output_token", "j_per_1k_tokens", "co2_per_1k_tokens", "j_per_request"):
        assert session.prom.query(f"{RULES[figure]}{{{pod}}}") == [], figure  # absent, never NaN or +Inf
    assert session.one(f"{RULES['tokens_per_kwh']}{{{pod}}}") == 0.0


@pytest.mark.parametrize("engine", ENGINES)
def test_per_model_joules_per_output_token(session: Session, engine: str) -> None:
    rule = "model_server:inference_energy_joules_per_output_token:ratio_rate5m"
    big = session.one(f'{rule}{{model="llama-3-70b", server="{engine}"}}')
    small = session.one(f'{rule}{{model="llama-3-8b", server="{engine}"}}')
    assert big is not None and small is not None
    expected_small = EXPECTED_POD["shared"]["j_per_output_token"] if engine == "tgi" else MODEL_8B_J_PER_OUTPUT_TOKEN
    _report(f"{engine} llama-3-8b per model", small, expected_small)
    assert big == pytest.approx(EXPECTED_POD["tp2"]["j_per_output_token"], rel=0.01)
    assert small == pytest.approx(expected_small, rel=0.01)
    # Triton names its own models: the pods' `model` label was not allowed to replace them.
    assert session.prom.query('namespace_pod_model:inference_tokens:rate5m{model="not-the-model"}') == []


def test_bad_servers_fail_their_own_scrape_and_nothing_else(session: Session) -> None:
    for pod in ("vllm-hung", "sglang-flood", "triton-runaway", "tgi-garbage"):
        assert session.one(f'up{{job="inference-servers", pod="{pod}"}}') == 0.0, pod
        assert session.prom.query(f'namespace_pod_model:inference_tokens:rate5m{{pod="{pod}"}}') == [], pod
    assert session.one('count(up{job="inference-servers"} == 1)') == 12.0
