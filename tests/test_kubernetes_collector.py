"""The kubernetes collector: a real gRPC kubelet stand-in, the real client, and (end to end) the exporter's
GPU collector and sampler on the fake NVML library.

pynvml keeps process-wide state, so the end-to-end part runs the exporter side in a child process that the
test drives line by line over stdin ("refresh", "sample <t>"): the test moves the fake driver's frozen
clock, moves GPUs between pods on the fake kubelet, and checks every counter against the exact energy of
the scenario's constant power traces.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fakenvml import CompilerNotFound, Constant, Driver, Process, Scenario, a100, build_library, h100, mig_uuids
from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import NoData
from gpu_energy_exporter.collectors.kubernetes.assignments import PodRef
from gpu_energy_exporter.collectors.kubernetes.collector import (
    CONTAINER_ENERGY,
    GPU_POD_INFO,
    POD_ENERGY,
    POD_PROVISIONAL,
    POD_RESOURCES_AVAILABLE,
    UNATTRIBUTED_ENERGY,
    KubernetesCollector,
)
from gpu_energy_exporter.collectors.kubernetes.podresources import PodResourcesWatcher
from gpu_energy_exporter.collectors.kubernetes.testing import FakeKubelet, fake_pod
from gpu_energy_exporter.core.metrics import CATALOGUE
from gpu_energy_exporter.core.state import GPUIdentity, GPUProcess, GPUReading, GPUState, MIGDevice
from gpu_energy_exporter.daemon.config import load_config

REPO = Path(__file__).resolve().parent.parent
Sample = tuple[str, tuple[tuple[str, str], ...]]


def samples(families: list[Metric]) -> dict[Sample, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(got: dict[Sample, float], name: str, **labels: str) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


def names(got: dict[Sample, float], name: str) -> list[dict[str, str]]:
    return [dict(lbl) for (n, lbl) in got if n == name]


@pytest.fixture
def socket_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("kl") / "kubelet.sock")


def test_metric_names_and_labels_are_declared_once() -> None:
    assert CATALOGUE["gpuenergy_k8s_gpu_pod_info"].labels == (
        "gpu", "gpu_uuid", "mig_uuid", "k8s_namespace", "k8s_pod", "k8s_container")
    assert POD_ENERGY.name == "gpuenergy_k8s_pod_energy_joules_total"
    assert POD_ENERGY.labels == ("k8s_namespace", "k8s_pod", "method")
    assert CONTAINER_ENERGY.name == "gpuenergy_k8s_container_energy_joules_total"
    assert CONTAINER_ENERGY.labels == ("k8s_namespace", "k8s_pod", "k8s_container", "method")
    assert UNATTRIBUTED_ENERGY.labels == ("gpu", "gpu_uuid")
    spec_names = {s.name for s in KubernetesCollector(tuple, _NullSource()).specs()}
    assert spec_names == {GPU_POD_INFO.name, POD_ENERGY.name, CONTAINER_ENERGY.name, UNATTRIBUTED_ENERGY.name,
                          POD_RESOURCES_AVAILABLE.name, POD_PROVISIONAL.name}
    assert POD_PROVISIONAL.name == "gpuenergy_k8s_pod_energy_provisional_joules"
    assert POD_PROVISIONAL.labels == ("k8s_namespace", "k8s_pod")


class _NullSource:
    def start(self) -> None: ...

    def view(self) -> Any:
        raise AssertionError("not used")

    def close(self) -> None: ...


# ---- in process, synthetic GPU states --------------------------------------------------------------------

G0, G1 = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-aaaaaaaa-1111-1111-1111-111111111111"


def identity(index: int, uuid: str, migs: tuple[str, ...] = ()) -> GPUIdentity:
    return GPUIdentity(index, uuid, "NVIDIA Fake", "", "hopper", "9.0", "counter", True, bool(migs),
                       tuple(MIGDevice(m, uuid, i) for i, m in enumerate(migs)))


class States:
    """What the GPU collector would hand over: settable energies and processes."""

    def __init__(self) -> None:
        self.energy = {G0: 0.0, G1: 0.0}
        self.processes: dict[str, tuple[GPUProcess, ...]] = {}

    def __call__(self) -> tuple[GPUState, ...]:
        return tuple(
            GPUState(identity(i, u), True, GPUReading(0.0, processes=self.processes.get(u, ())),
                     self.energy[u], 0, 0.0)
            for i, u in enumerate((G0, G1))
        )


def test_from_config_reads_socket_and_interval_and_refreshes_off_the_sample_path(socket_path: str) -> None:
    cfg = load_config(["--collector.kubernetes", "--kubernetes.pod-resources-socket", socket_path,
                       "--kubernetes.refresh-interval", "1h"], {})
    states = States()
    collector = KubernetesCollector.from_config(cfg, states)
    with FakeKubelet(socket_path) as kubelet:
        kubelet.set_pods([fake_pod("ml", "a", {"c": [G0]})])
        try:
            got = samples(collector.update())
            for _ in range(20):
                states.energy[G0] += 5.0
                got = samples(collector.update())
        finally:
            collector.close()
        assert kubelet.calls == 1  # one List at start, none per update (the next is due in an hour)
    assert value(got, "gpuenergy_k8s_pod_energy_joules_total", k8s_namespace="ml", k8s_pod="a",
                 method="exclusive") == pytest.approx(100.0)
    assert value(got, "gpuenergy_k8s_pod_resources_available", reason="") == 1.0
    assert names(got, "gpuenergy_k8s_gpu_pod_info") == [
        {"gpu": "0", "gpu_uuid": G0, "mig_uuid": "", "k8s_namespace": "ml", "k8s_pod": "a", "k8s_container": "c"}
    ]


def test_missing_socket_is_no_data_with_the_reason_and_unattributed_energy(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    states = States()
    collector = KubernetesCollector(states, PodResourcesWatcher(socket_path, 0.05))
    try:
        for _ in range(3):
            states.energy[G1] += 10.0
            with pytest.raises(NoData) as info:
                collector.update()
            time.sleep(0.06)  # the watcher thread retries meanwhile
    finally:
        collector.close()
    got = samples(info.value.families)
    assert value(got, "gpuenergy_k8s_pod_resources_available", reason="socket_missing") == 0.0
    assert value(got, "gpuenergy_k8s_unattributed_energy_joules_total", gpu="1", gpu_uuid=G1) == 20.0
    assert names(got, "gpuenergy_k8s_gpu_pod_info") == []
    lines = [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(lines) == 1 and socket_path in lines[0]


def test_shared_gpu_split_by_sm_utilisation_of_resolved_processes(socket_path: str) -> None:
    states = States()
    a, b = PodRef("ml", "a", "c"), PodRef("ml", "b", "c")
    owners = {101: a, 102: b, 103: PodRef("other", "x", "y")}
    asked: list[tuple[int, tuple[PodRef, ...]]] = []

    def pid_to_pod(pid: int, candidates: Any) -> PodRef | None:
        asked.append((pid, tuple(candidates)))
        return owners.get(pid)

    collector = KubernetesCollector(states, PodResourcesWatcher(socket_path, 3600), pid_to_pod=pid_to_pod)
    with FakeKubelet(socket_path) as kubelet:
        kubelet.set_pods([fake_pod("ml", "a", {"c": [G1 + "::0"]}), fake_pod("ml", "b", {"c": [G1 + "::1"]})])
        try:
            collector.update()
            states.processes[G1] = (GPUProcess(101, None, 60.0), GPUProcess(102, None, 20.0),
                                    GPUProcess(103, None, 99.0), GPUProcess(104, None, None))
            states.energy[G1] = 800.0
            got = samples(collector.update())
            states.processes[G1] = ()
            states.energy[G1] = 1000.0
            got = samples(collector.update())
        finally:
            collector.close()

    def joules(pod: str, method: str) -> float | None:
        return value(got, "gpuenergy_k8s_container_energy_joules_total", k8s_namespace="ml", k8s_pod=pod,
                     k8s_container="c", method=method)

    # 103 runs in a pod not holding this GPU: it keeps its share (99 of 179), unattributed (issue 19); 104 has
    # no utilisation sample: it used no SMs in the period.
    assert joules("a", "sm_utilization") == pytest.approx(800.0 * 60 / 179)
    assert joules("b", "sm_utilization") == pytest.approx(800.0 * 20 / 179)
    assert value(got, "gpuenergy_k8s_unattributed_energy_joules_total", gpu="1", gpu_uuid=G1) == pytest.approx(
        800.0 * 99 / 179)
    assert joules("a", "shared_even") == pytest.approx(100.0)  # no processes: even
    assert joules("b", "shared_even") == pytest.approx(100.0)
    assert {pid for pid, _ in asked} == {101, 102, 103, 104}
    assert all(c == (a, b) for _, c in asked)


def test_failing_kubelet_marks_the_collector_failed_but_keeps_counting(socket_path: str) -> None:
    states = States()
    watcher = PodResourcesWatcher(socket_path, 3600, timeout_s=2.0)
    collector = KubernetesCollector(states, watcher)
    with FakeKubelet(socket_path) as kubelet:
        kubelet.set_pods([fake_pod("ml", "a", {"c": [G0]})])
        try:
            collector.update()
            kubelet.fail_with = grpc.StatusCode.UNAVAILABLE
            watcher.refresh()
            states.energy[G0] = 50.0
            with pytest.raises(NoData, match="UNAVAILABLE") as info:
                collector.update()
        finally:
            collector.close()
    got = samples(info.value.families)
    assert value(got, "gpuenergy_k8s_pod_resources_available", reason="rpc_error") == 0.0
    # The pod still holds its GPU (the last known map): its counter keeps rising.
    assert value(got, "gpuenergy_k8s_pod_energy_joules_total", k8s_namespace="ml", k8s_pod="a",
                 method="exclusive") == 50.0


# ---- end to end: the exporter's GPU collector and sampler on the fake NVML library --------------------------

DRIVER = r"""
import json, logging, sys
from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.collectors.kubernetes.collector import KubernetesCollector
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.devices.nvml import NVMLBackend
from gpu_energy_exporter.collectors.kubernetes.assignments import PodRef
from gpu_energy_exporter.collectors.kubernetes.podresources import PodResourcesWatcher
from gpu_energy_exporter.engine.sampler import Sampler

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
owners = {int(pid): PodRef(*ref) for pid, ref in json.loads(sys.argv[1]).items()}
cfg = load_config(sys.argv[2:], {})
now = [0.0]
# The energy counter's plausibility is judged on the scenario's time (the frozen clock the test moves), not
# on the milliseconds between two test samples. SM-weighted attribution needs each process's SM
# utilisation, which the GPU collector reads only on request.
gpu = GPUCollector(lambda: NVMLBackend(cfg.nvml_library), power_interval=cfg.collector_power_interval,
                   monotonic=lambda: now[0], process_utilization=True)
watcher = PodResourcesWatcher(cfg.kubernetes_pod_resources_socket, cfg.kubernetes_refresh_interval)
k8s = KubernetesCollector(gpu.states, watcher, pid_to_pod=lambda pid, cands: owners.get(pid),
                          series_grace_s=30.0, clock=lambda: now[0])
sampler = Sampler([gpu, k8s], interval=cfg.collector_interval)
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "refresh":
        watcher.refresh()
        out = {}
    elif cmd == "sample":
        now[0] = float(arg[0])
        snap = sampler.sample_once()
        out = [[s.name, s.labels, s.value] for f in snap.families for s in f.samples
               if s.name.startswith(("gpuenergy_k8s_", "gpuenergy_gpu_energy_joules", "gpuenergy_collector_"))]
    print(json.dumps(out), flush=True)
sampler.stop()
"""


class Exporter:
    """The child process running the real collectors; ``send`` returns its JSON answer."""

    def __init__(self, argv: list[str], owners: dict[int, tuple[str, str, str]], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(owners), *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        )

    def send(self, line: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise AssertionError("exporter child died: " + self.stop())
        return json.loads(answer)

    def sample(self, t: float) -> dict[Sample, float]:
        return {(n, tuple(sorted(lbl.items()))): v for n, lbl, v in self.send(f"sample {t}")}

    def stop(self) -> str:
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        err = self.proc.stderr.read()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return err


@pytest.fixture(scope="module")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_library(tmp_path_factory.mktemp("fakenvml"))
    except CompilerNotFound as exc:
        pytest.skip(f"no C compiler for the fake NVML library: {exc}")


@pytest.fixture
def exporter_setup(tmp_path: Path, socket_path: str, fake_nvml_lib: Path) -> Iterator[dict[str, Any]]:
    epoch = time.time() - 10_000
    g2 = h100(2, power=Constant(300.0))
    migs = mig_uuids(g2.uuid, 3)
    gpus = [
        h100(0, power=Constant(100.0)),
        a100(1, power=Constant(200.0), processes=(Process(101, 1 << 30, 30), Process(102, 1 << 30, 10))),
        h100(2, power=Constant(300.0), mig_mode=1, mig_devices=migs),
    ]
    scenario_file = tmp_path / "scenario.ini"

    def at(t: float) -> None:
        Scenario(epoch=epoch, driver=Driver(frozen_time=epoch + t), gpus=gpus).write(scenario_file)

    at(10.0)
    argv = ["--nvml.library", str(fake_nvml_lib), "--collector.kubernetes",
            "--kubernetes.pod-resources-socket", socket_path, "--kubernetes.refresh-interval", "1h"]
    owners = {101: ("ml", "b", "trainer"), 102: ("ml", "c", "trainer")}
    with FakeKubelet(socket_path) as kubelet:
        exporter = Exporter(argv, owners, {"FAKE_NVML_SCENARIO": str(scenario_file)})
        try:
            yield {"kubelet": kubelet, "exporter": exporter, "at": at, "uuids": [g.uuid for g in gpus],
                   "migs": migs}
        finally:
            exporter.stop()


def test_pods_come_and_go_and_energy_integrates_exactly(exporter_setup: dict[str, Any]) -> None:
    kubelet: FakeKubelet = exporter_setup["kubelet"]
    ex: Exporter = exporter_setup["exporter"]
    at = exporter_setup["at"]
    u0, u1, u2 = exporter_setup["uuids"]
    mig3g, mig1g, _ = exporter_setup["migs"]

    def pod(name: str, *devices: str | tuple[str, str]) -> Any:
        return fake_pod("ml", name, {"trainer": list(devices)})

    # t=10: A holds GPU 0; B and C time-share GPU 1; D and E hold MIG instances of GPU 2.
    kubelet.set_pods([pod("a", u0), pod("b", ("nvidia.com/gpu.shared", u1 + "::0")),
                      pod("c", ("nvidia.com/gpu.shared", u1 + "::1")),
                      pod("d", ("nvidia.com/mig-3g.40gb", mig3g)), pod("e", ("nvidia.com/mig-1g.10gb", mig1g))])
    ex.send("refresh")
    base = ex.sample(10.0)
    assert value(base, "gpuenergy_gpu_energy_joules_total", gpu="0", gpu_uuid=u0) == pytest.approx(1000.0)

    def pod_j(got: dict[Sample, float], name: str, method: str) -> float | None:
        return value(got, "gpuenergy_k8s_pod_energy_joules_total", k8s_namespace="ml", k8s_pod=name,
                     method=method)

    assert pod_j(base, "a", "exclusive") == 0.0  # series exist from the first sample

    at(20.0)
    got = ex.sample(20.0)
    assert value(got, "gpuenergy_collector_success", collector="kubernetes") == 1.0
    assert pod_j(got, "a", "exclusive") == pytest.approx(1000.0)  # 100 W x 10 s
    assert pod_j(got, "b", "sm_utilization") == pytest.approx(1500.0)  # 2000 J by SM 30:10
    assert pod_j(got, "c", "sm_utilization") == pytest.approx(500.0)
    assert pod_j(got, "d", "mig_slices") == pytest.approx(2250.0)  # 3000 J by slices 3:1, never 2x3000
    assert pod_j(got, "e", "mig_slices") == pytest.approx(750.0)
    info = names(got, "gpuenergy_k8s_gpu_pod_info")
    assert {(i["gpu"], i["k8s_pod"], i["mig_uuid"]) for i in info} == {
        ("0", "a", ""), ("1", "b", ""), ("1", "c", ""), ("2", "d", mig3g), ("2", "e", mig1g)}

    # A and B finish; F gets GPU 0; C now has GPU 1 to itself.
    kubelet.set_pods([pod("f", u0), pod("c", ("nvidia.com/gpu.shared", u1 + "::1")),
                      pod("d", ("nvidia.com/mig-3g.40gb", mig3g)), pod("e", ("nvidia.com/mig-1g.10gb", mig1g))])
    ex.send("refresh")
    at(30.0)
    got = ex.sample(30.0)
    assert pod_j(got, "a", "exclusive") == pytest.approx(1000.0)  # gone, kept for the grace period
    assert pod_j(got, "f", "exclusive") == pytest.approx(1000.0)
    assert pod_j(got, "c", "exclusive") == pytest.approx(2000.0)
    assert pod_j(got, "c", "sm_utilization") == pytest.approx(500.0)
    assert pod_j(got, "d", "mig_slices") == pytest.approx(4500.0)
    assert {i["k8s_pod"] for i in names(got, "gpuenergy_k8s_gpu_pod_info")} == {"c", "d", "e", "f"}

    # Nobody on GPU 0 or GPU 1 for 10 s: their energy is unattributed, not given to anyone.
    kubelet.set_pods([pod("d", ("nvidia.com/mig-3g.40gb", mig3g)), pod("e", ("nvidia.com/mig-1g.10gb", mig1g))])
    ex.send("refresh")
    at(40.0)
    got = ex.sample(40.0)
    assert value(got, "gpuenergy_k8s_unattributed_energy_joules_total", gpu="0", gpu_uuid=u0) == \
        pytest.approx(1000.0)

    # Conservation: pods + unattributed == the GPUs' own energy counters since the first sample.
    pods_total = sum(v for (n, _), v in got.items() if n == "gpuenergy_k8s_pod_energy_joules_total")
    unattributed = sum(v for (n, _), v in got.items() if n == "gpuenergy_k8s_unattributed_energy_joules_total")
    containers = sum(v for (n, _), v in got.items() if n == "gpuenergy_k8s_container_energy_joules_total")
    gpu_delta = sum(v - base[k] for k, v in got.items() if k[0] == "gpuenergy_gpu_energy_joules_total")
    assert gpu_delta == pytest.approx(3 * 600.0 * 10)  # (100 + 200 + 300) W x 30 s
    assert pods_total + unattributed == pytest.approx(gpu_delta)
    assert containers == pytest.approx(pods_total)

    # 30 s after they last held a GPU, A, B, C and F expire; D and E stay.
    at(70.5)
    got = ex.sample(70.5)
    assert {lbl["k8s_pod"] for lbl in names(got, "gpuenergy_k8s_pod_energy_joules_total")} == {"d", "e"}


def test_kubelet_outage_in_the_running_exporter(exporter_setup: dict[str, Any]) -> None:
    kubelet: FakeKubelet = exporter_setup["kubelet"]
    ex: Exporter = exporter_setup["exporter"]
    at = exporter_setup["at"]
    u0 = exporter_setup["uuids"][0]
    kubelet.set_pods([fake_pod("ml", "a", {"trainer": [u0]})])
    ex.send("refresh")
    ex.sample(10.0)
    kubelet.fail_with = grpc.StatusCode.UNAVAILABLE
    ex.send("refresh")
    at(20.0)
    got = ex.sample(20.0)
    assert value(got, "gpuenergy_collector_success", collector="kubernetes") == 0.0
    assert value(got, "gpuenergy_collector_success", collector="gpu") == 1.0  # only ours failed
    assert value(got, "gpuenergy_k8s_pod_energy_joules_total", k8s_namespace="ml", k8s_pod="a",
                 method="exclusive") == pytest.approx(1000.0)
    kubelet.fail_with = None
    ex.send("refresh")
    got = ex.sample(20.0)
    assert value(got, "gpuenergy_collector_success", collector="kubernetes") == 1.0
