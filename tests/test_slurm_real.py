"""Slurm jobs charged their GPUs' energy, with a real Slurm (issue 23): munged, slurmctld and slurmd from
Debian's slurm-wlm on loopback run the shipped prolog and epilog; the exporter on the fake NVML library
reads the job-mapping directory they keep; nothing in the jobs knows about the exporter.

How the truth is made by hand: every GPU draws 0 W except for bursts the test scripts into the fake
library while a job holds the GPU (the job waits for a release file, so the burst sits well inside the
job's lifetime whatever the scheduling delays). A job's true energy is then the bursts' energy on its
GPUs, exactly: 300 W for 3 s is 900 J. The exporter must charge it within 1%, and charge nothing to a
job for energy drawn outside it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakenvml import Scenario, Steps, h100
from helpers import ExporterProcess, sample_value, samples, wait_until
from slurmcluster import SlurmCluster, missing_binaries

pytestmark = pytest.mark.slow

LONG = 1e6  # seconds: "for the rest of the test"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd runs job prologs as root and needs stand-in GPU device nodes (mknod)")
    missing = missing_binaries()
    assert not missing, f"{missing} not installed: `make test` installs Debian's slurm-wlm and munge"
    root = tmp_path_factory.mktemp("slurm")
    c = SlurmCluster(root, root / "job-map", gpus=2)
    try:
        yield c.start()
    finally:
        c.stop()


class Bursts:
    """The fake library's scenario: 0 W on every GPU, plus scripted bursts (GPU index, start, s, W)."""

    def __init__(self, path: Path, gpus: int) -> None:
        self.path = path
        self.epoch = time.time()
        self.gpus = gpus
        self.bursts: list[tuple[int, float, float, float]] = []
        self._write()

    def _trace(self, index: int) -> Steps:
        steps: list[tuple[float, float]] = []
        t = 0.0
        for _gpu, start, length, watts in sorted(b for b in self.bursts if b[0] == index):
            if start > t:
                steps.append((start - t, 0.0))
            steps.append((length, watts))
            t = start + length
        steps.append((LONG, 0.0))
        return Steps(tuple(steps))

    def _write(self) -> None:
        Scenario(epoch=self.epoch, gpus=[h100(i, power=self._trace(i)) for i in range(self.gpus)]).write(self.path)

    def add(self, index: int, length_s: float, watts: float, lead_s: float = 0.5) -> float:
        """A burst starting ``lead_s`` from now (the past stays as it was: the counter never jumps).
        Returns the unix time it ends."""
        start = time.time() - self.epoch + lead_s
        self.bursts.append((index, start, length_s, watts))
        self._write()
        return self.epoch + start + length_s


def job_gpus(exp: ExporterProcess, job: str) -> list[str]:
    text = exp.metrics()
    return sorted(lbl["gpu"] for lbl, _ in samples(text, "gpuenergy_slurm_gpu_job_info") if lbl["job_id"] == job)


def job_energy(exp: ExporterProcess, job: str) -> float:
    return sum(v for lbl, v in samples(exp.metrics(), "gpuenergy_slurm_job_energy_joules_total")
               if lbl["job_id"] == job)


def hold(cluster: SlurmCluster, exp: ExporterProcess, name: str, *args: str, gpus: int = 1
         ) -> tuple[str, Path, list[str]]:
    """Submit a job that runs until its release file appears; wait until the exporter sees its ``gpus``
    GPUs (the prolog writes one file per GPU)."""
    release = cluster.root / f"release-{name}"
    job = cluster.sbatch(*args, wrap=f"while [ ! -e '{release}' ]; do sleep 0.1; done")
    held = wait_until(lambda: len(job_gpus(exp, job)) >= gpus and job_gpus(exp, job), timeout=60,
                      what=f"job {job} on /metrics")
    return job, release, held


def release(cluster: SlurmCluster, exp: ExporterProcess, job: str, flag: Path, after: float) -> None:
    """Release the job once ``after`` (unix time) is 1 s past, then wait for its epilog to unmap it."""
    time.sleep(max(0.0, after + 1.0 - time.time()))
    flag.touch()
    wait_until(lambda: not job_gpus(exp, job), timeout=60, what=f"job {job} to leave its GPUs")


def test_jobs_are_charged_their_gpus_energy_with_a_real_slurm(
    cluster: SlurmCluster, fake_nvml_lib: Path, tmp_path: Path, start_exporter: type[ExporterProcess]
) -> None:
    bursts = Bursts(tmp_path / "scenario.ini", gpus=2)
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=100ms", "--collector.slurm",
                          f"--collector.slurm.job-mapping-dir={cluster.mapping_dir}"],
                         {"FAKE_NVML_SCENARIO": str(bursts.path)}).wait_ready()
    assert sample_value(exp.metrics(), "gpuenergy_slurm_job_mapping_available") == 0.0  # no job yet

    # Two jobs in sequence on one GPU: 900 J, then 500 J, and energy between them charged to nobody.
    a, flag_a, gpus_a = hold(cluster, exp, "a", "--gres=gpu:1")
    release(cluster, exp, a, flag_a, bursts.add(int(gpus_a[0]), 3.0, 300.0))
    idle_end = bursts.add(int(gpus_a[0]), 1.0, 400.0, lead_s=0.2)  # no job holds the GPU: unattributed
    time.sleep(max(0.0, idle_end + 0.5 - time.time()))
    b, flag_b, gpus_b = hold(cluster, exp, "b", "--gres=gpu:1")
    assert gpus_b == gpus_a == ["0"], "Slurm gives the lowest free GPU: both jobs ran on GPU 0"
    release(cluster, exp, b, flag_b, bursts.add(0, 2.5, 200.0))

    # One job on two GPUs: 300 W x 2 s + 150 W x 2 s.
    c, flag_c, gpus_c = hold(cluster, exp, "c", "--gres=gpu:2", gpus=2)
    assert gpus_c == ["0", "1"]
    end = max(bursts.add(0, 2.0, 300.0), bursts.add(1, 2.0, 150.0))
    release(cluster, exp, c, flag_c, end)

    # Two jobs sharing one GPU (shard gres): the fake library's processes are not in their cgroups, so the
    # split is even: 250 J each of a 500 J burst.
    d, flag_d, gpus_d = hold(cluster, exp, "d", "--gres=shard:1")
    e, flag_e, gpus_e = hold(cluster, exp, "e", "--gres=shard:1")
    assert gpus_d == gpus_e, "both shards on one GPU"
    end = bursts.add(int(gpus_d[0]), 2.5, 200.0)
    release(cluster, exp, d, flag_d, end)
    release(cluster, exp, e, flag_e, end)

    truth = {a: 900.0, b: 500.0, c: 900.0, d: 250.0, e: 250.0}
    got = {job: job_energy(exp, job) for job in truth}
    for job, want in truth.items():
        assert got[job] == pytest.approx(want, rel=0.01), (job, got, truth)
    text = exp.metrics()
    # (d and e each also held the GPU alone for a moment, at 0 W: an exclusive series of 0 J)
    methods = {(lbl["job_id"], lbl["method"])
               for lbl, v in samples(text, "gpuenergy_slurm_job_energy_joules_total") if v > 0}
    assert methods == {(a, "exclusive"), (b, "exclusive"), (c, "exclusive"), (d, "shared_even"),
                       (e, "shared_even")}
    # Every joule the GPUs drew is charged to a job or to nobody, never twice.
    unattributed = sum(v for _, v in samples(text, "gpuenergy_slurm_unattributed_energy_joules_total"))
    gpu_total = sum(v for _, v in samples(text, "gpuenergy_gpu_energy_joules_total"))
    assert sum(got.values()) + unattributed == pytest.approx(gpu_total, rel=1e-9, abs=1e-6)
    assert unattributed == pytest.approx(400.0, rel=0.01)  # the burst between jobs a and b
    # The prolog recorded user and partition for the job's info series.
    info = [lbl for lbl, _ in samples(text, "gpuenergy_slurm_job_info") if lbl["job_id"] == a]
    assert info and info[0]["user"] == "root" and info[0]["partition"] == "test"
    # The epilog left the directory as it found it: no job files, no info files.
    assert not [p for p in cluster.mapping_dir.iterdir() if p.is_file() and not p.name.startswith(".")]
    assert not list((cluster.mapping_dir / ".info").iterdir())


def test_the_prolog_runs_while_the_exporter_is_down(cluster: SlurmCluster) -> None:
    """No exporter at all: jobs start and end normally, and the directory is kept for when it comes."""
    flag = cluster.root / "release-down"
    job = cluster.sbatch("--gres=gpu:1", wrap=f"while [ ! -e '{flag}' ]; do sleep 0.1; done")
    wait_until(lambda: (cluster.mapping_dir / "0").exists() and job in (cluster.mapping_dir / "0").read_text(),
               timeout=60, what="the prolog to record the job")
    assert cluster.state(job) == "RUNNING"
    flag.touch()
    wait_until(lambda: not (cluster.mapping_dir / "0").exists(), timeout=60, what="the epilog to remove it")
    assert shutil.which("sbatch")
