"""Pods time-slicing one GPU are charged by what their processes run (issue 19): the exporter process on the
fake NVML (two processes at 80 % and 20 % SM), the kubelet's pod-resources API over real gRPC
(``FakeKubelet``), and a fixture host /proc (``--path.procfs``) whose entries place each process in its pod
(``NSpid``, cgroup, ``HOSTNAME``), as the DaemonSet's hostPID gives the exporter on a node."""

from __future__ import annotations

import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from fakenvml import Constant, Process, Scenario, h100
from helpers import ExporterProcess, sample_value, wait_until

pytest.importorskip("grpc")

from gpu_energy_exporter.collectors.kubernetes.testing import FakeKubelet, fake_pod  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "procfs-host"
GIB = 1 << 30
POD_UID = {"pod-a": "0f2b6a52-1d1e-4c4b-9a39-8f2b1c0de0a1", "pod-b": "6d7e8f90-2a3b-4c5d-8e9f-a0b1c2d3e4f5"}


def host_proc(root: Path, pid: int, pod: str, ns_pid: int) -> None:
    """``<root>/<pid>``: a containerised process of ``pod`` as the host's /proc shows it."""
    d = root / str(pid)
    d.mkdir(parents=True)
    container = f"{pid:064x}"
    (d / "status").write_text(f"Name:\tpython\nPid:\t{pid}\nNSpid:\t{pid}\t{ns_pid}\n")
    uid = POD_UID[pod].replace("-", "_")
    (d / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
                              f"cri-containerd-{container}.scope\n")
    (d / "environ").write_bytes(f"PATH=/usr/bin\0HOSTNAME={pod}\0HOME=/root\0".encode())


def _scrape(exp: ExporterProcess) -> str:
    with urllib.request.urlopen(exp.scrape_url, timeout=10) as r:
        return r.read().decode()


def test_pods_time_slicing_a_gpu_at_80_20_sm_are_charged_80_20(
        start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURE, procfs)
    host_proc(procfs, 4001, "pod-a", 7)
    host_proc(procfs, 4002, "pod-b", 7)  # the same pid inside its own container: told apart by the host pid
    gpu = h100(0, power=Constant(500.0), processes=(Process(4001, GIB, 80), Process(4002, GIB, 20)))
    scenario = tmp_path / "scenario.ini"
    Scenario(epoch=time.time() - 60, gpus=[gpu]).write(scenario)
    sock = str(tmp_path / "kubelet.sock")
    with FakeKubelet(sock) as kubelet:
        kubelet.set_pods([fake_pod("ml", "pod-a", {"train": [("nvidia.com/gpu", gpu.uuid + "::0")]}),
                          fake_pod("ml", "pod-b", {"train": [("nvidia.com/gpu", gpu.uuid + "::1")]})])
        from gpu_energy_exporter.daemon.config import FLAGS

        new = "--collector.gpu.process-interval=200ms"  # (absent before the change: measure it all the same)
        # The pods' counters are settled at each energy-counter read (issue 28): read it every second so the
        # window below spans several settled spans.
        exp = start_exporter([
            f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--collector.energy-interval=1s",
            "--collector.kubernetes",
            f"--kubernetes.pod-resources-socket={sock}", "--kubernetes.refresh-interval=1s",
            f"--path.procfs={procfs}", *([new] if any(f.name == "collector.gpu.process-interval" for f in FLAGS)
                                         else []),
        ], {"FAKE_NVML_SCENARIO": str(scenario)}).wait_ready()

        def pod_j(text: str, pod: str) -> float:
            return sum(v for m in ("sm_utilization", "shared_even") if (v := sample_value(
                text, "gpuenergy_k8s_pod_energy_joules_total", k8s_namespace="ml", k8s_pod=pod, method=m))
                is not None)

        wait_until(lambda: pod_j(_scrape(exp), "pod-a") > 0 and pod_j(_scrape(exp), "pod-b") > 0, timeout=30,
                   what="both pods to be charged")
        time.sleep(1.0)  # past the first samples (pods seen, utilisation not read yet)
        before = _scrape(exp)
        time.sleep(3.0)
        after = _scrape(exp)
    da = pod_j(after, "pod-a") - pod_j(before, "pod-a")
    db = pod_j(after, "pod-b") - pod_j(before, "pod-b")
    gpu_j = (sample_value(after, "gpuenergy_gpu_energy_joules_total", gpu="0") or 0.0) - \
        (sample_value(before, "gpuenergy_gpu_energy_joules_total", gpu="0") or 0.0)
    # The pods' counters move at each counter read (settled spans), the GPU's at each sample: over the
    # window the two pods share the spans settled in it, 80/20, and those are about the window's energy.
    both = da + db
    print(f"\n[issue 19] pods 80/20 SM: pod-a {da:.1f} J ({da / both:.1%}), pod-b {db:.1f} J ({db / both:.1%}) "
          f"of the {both:.1f} J settled in the window (the GPU's counter: {gpu_j:.1f} J)")
    assert gpu_j > 1000 and both == pytest.approx(gpu_j, rel=0.5)
    assert da == pytest.approx(0.8 * both, rel=0.01)
    assert db == pytest.approx(0.2 * both, rel=0.01)
