"""Slurm job mapping (issue 23): the directory format, job cgroups, the per-job split, and the shipped
prolog/epilog scripts run for real with ``sh`` (idempotent, concurrent jobs on one GPU, never failing).

The real Slurm end to end (slurmctld + slurmd running these scripts) is tests/test_slurm_real.py.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpu_energy_exporter.collectors.slurm.collector import SlurmCollector
from gpu_energy_exporter.collectors.slurm.jobs import (
    METHOD_EXCLUSIVE,
    METHOD_MIG_SLICES,
    METHOD_SHARED_EVEN,
    METHOD_SM_UTILIZATION,
    JobEnergyAttributor,
    JobSlot,
    split,
)
from gpu_energy_exporter.collectors.slurm.mapping import JobInfo, job_of_cgroup, read_mapping
from gpu_energy_exporter.core.state import GPUIdentity, GPUProcess, GPUReading, GPUState

REPO = Path(__file__).resolve().parent.parent
PROLOG = REPO / "deploy" / "slurm" / "gpu-energy-prolog.sh"
EPILOG = REPO / "deploy" / "slurm" / "gpu-energy-epilog.sh"


def run_script(script: Path, mapping: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "GPU_ENERGY_JOB_MAPPING_DIR": str(mapping)}
    return subprocess.run(["sh", str(script)], env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_reads_dcgm_format_with_mig_instances_and_info(tmp_path: Path) -> None:
    (tmp_path / "0").write_text("101\n102\n\n101\n")
    (tmp_path / "3.2").write_text("103\n")
    (tmp_path / "1").write_text("")  # an emptied file: no job
    (tmp_path / ".lock").write_text("")
    (tmp_path / "README").write_text("not a GPU file")
    (tmp_path / ".info").mkdir()
    (tmp_path / ".info" / "101").write_text("user=alice\naccount=ml\npartition=gpu\nsluid=\nbogus=1\n")
    (tmp_path / ".info" / "103").write_text("user=bob\npartition=evil\x1b[31m\n")
    m = read_mapping(tmp_path)
    assert m.available and m.problems == ()
    assert m.gpus == {(0, None): ("101", "102"), (3, 2): ("103",)}
    assert m.info["101"] == JobInfo("101", "alice", "ml", "gpu", "")
    assert m.info["102"] == JobInfo("102")  # no info file: known job, unknown user
    assert m.info["103"] == JobInfo("103", user="bob")  # a value with a control character is dropped


def test_bad_lines_and_oversized_files_lose_only_themselves(tmp_path: Path) -> None:
    (tmp_path / "0").write_text("101\n$(reboot)\n102\n")
    (tmp_path / "1").write_bytes(b"7\n" * 40_000)  # 80 kB: over the bound
    m = read_mapping(tmp_path)
    assert m.gpus == {(0, None): ("101", "102")}
    assert any("not a job id" in p for p in m.problems)
    assert any(p.startswith("1:") and "larger than" in p for p in m.problems)


def test_missing_directory_is_no_data_not_a_problem(tmp_path: Path) -> None:
    m = read_mapping(tmp_path / "absent")
    assert not m.available and m.gpus == {} and m.problems == ()


@pytest.mark.parametrize(
    ("cgroup", "job"),
    [
        ("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n", "4242"),
        ("0::/system.slice/node7_slurmstepd.scope/job_17/step_batch/user/task_0\n", "17"),  # multiple-slurmd
        ("12:devices:/slurm/uid_1000/job_99/step_0/task_0\n4:memory:/slurm/uid_1000/job_99/step_0\n", "99"),
        ("5:cpuset:/slurm_node3/uid_0/job_5/step_extern\n", "5"),
        ("0::/system.slice/slurmstepd.scope/s5K1KKYAYG5D00/step_0/user/task_0\n", "777"),  # Slurm 26.05 SLUID
        ("0::/system.slice/slurmstepd.scope/sZZZZZZZZZZZZZ/step_0\n", None),  # SLUID the prolog did not record
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
        ("0::/kubepods.slice/kubepods-pod1234.slice/cri-containerd-ab.scope\n", None),
    ],
)
def test_job_of_cgroup(cgroup: str, job: str | None) -> None:
    assert job_of_cgroup(cgroup, {"s5K1KKYAYG5D00": "777"}) == job


def test_split_rules_sum_to_the_delta() -> None:
    g = "GPU-a"
    assert split(100.0, [JobSlot(g, "1")]) == [("1", METHOD_EXCLUSIVE, 100.0)]
    assert split(100.0, [JobSlot(g, "1"), JobSlot(g, "2")]) == [
        ("1", METHOD_SHARED_EVEN, 50.0), ("2", METHOD_SHARED_EVEN, 50.0)]
    assert split(100.0, [JobSlot(g, "1"), JobSlot(g, "2")], {"1": 80.0, "2": 20.0}) == [
        ("1", METHOD_SM_UTILIZATION, 80.0), ("2", METHOD_SM_UTILIZATION, 20.0)]
    # MIG: 3 slices and 1 slice; two jobs on the 1-slice instance share its quarter
    mig = split(100.0, [JobSlot(g, "1", "0.1", 3), JobSlot(g, "2", "0.2", 1), JobSlot(g, "3", "0.2", 1)])
    assert mig == [("1", METHOD_MIG_SLICES, 75.0), ("2", METHOD_MIG_SLICES, 12.5), ("3", METHOD_MIG_SLICES, 12.5)]
    assert split(5.0, []) == []


def test_attributor_charges_each_interval_to_the_jobs_holding_the_gpu_at_its_start() -> None:
    """An interval goes to the jobs of the map at its start: the sample that first lists a job and the
    first that no longer does are the job's edges (the exporter reads the energy counters there)."""
    a = JobEnergyAttributor(grace_s=10)
    g0, g1 = "GPU-0", "GPU-1"
    a.update(0.0, {g0: 1000.0, g1: 50.0}, {g0: [JobSlot(g0, "7")]})  # baselines; job 7 listed from here
    a.update(1.0, {g0: 1300.0, g1: 250.0}, {g0: [JobSlot(g0, "7"), JobSlot(g0, "8")], g1: [JobSlot(g1, "8")]})
    a.update(2.0, {g0: 1500.0, g1: 450.0}, {g1: [JobSlot(g1, "8")]})
    a.update(3.0, {g0: 1400.0, g1: 550.0}, {})  # g0's counter went back: rebased, nothing charged
    assert a.job_energy() == {("7", METHOD_EXCLUSIVE): 300.0, ("7", METHOD_SHARED_EVEN): 100.0,
                              ("8", METHOD_SHARED_EVEN): 100.0, ("8", METHOD_EXCLUSIVE): 300.0}
    assert a.unattributed_energy() == {g0: 0.0, g1: 200.0}
    charged = sum(a.job_energy().values()) + sum(a.unattributed_energy().values())
    assert charged == (1500.0 - 1000.0) + (550.0 - 50.0)
    assert a.jobs()["8"] == (1.0, 2.0, (g0, g1))
    a.update(12.5, {g0: 1400.0, g1: 550.0}, {})
    assert set(a.jobs()) == set() and a.job_energy() == {}  # both jobs expired after the grace period


def test_prolog_and_epilog_are_idempotent_and_keep_other_jobs(tmp_path: Path) -> None:
    d = tmp_path / "map"
    for _ in range(2):
        r = run_script(PROLOG, d, SLURM_JOB_ID="11", SLURM_JOB_GPUS="0,2-3", SLURM_JOB_USER="alice",
                       SLURM_JOB_ACCOUNT="ml", SLURM_JOB_PARTITION="gpu")
        assert r.returncode == 0, r.stderr
    r = run_script(PROLOG, d, SLURM_JOB_ID="12", CUDA_VISIBLE_DEVICES="3")
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_text() for p in d.iterdir() if p.is_file() and not p.name.startswith(".")} == {
        "0": "11\n", "2": "11\n", "3": "11\n12\n"}
    m = read_mapping(d)
    assert m.info["11"] == JobInfo("11", "alice", "ml", "gpu")
    for _ in range(2):
        assert run_script(EPILOG, d, SLURM_JOB_ID="11").returncode == 0
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == ["3"]
    assert (d / "3").read_text() == "12\n"
    assert not (d / ".info" / "11").exists()
    assert not [p for p in d.rglob(".tmp*")]


def test_prolog_records_mig_instances_and_never_fails(tmp_path: Path) -> None:
    d = tmp_path / "map"
    assert run_script(PROLOG, d, SLURM_JOB_ID="5", SLURM_JOB_GPUS="1.2").returncode == 0
    assert (d / "1.2").read_text() == "5\n"
    bad = run_script(PROLOG, d, SLURM_JOB_ID="5; rm -rf /", SLURM_JOB_GPUS="0")
    assert bad.returncode == 0 and "not a job id" in bad.stderr and not (d / "0").exists()
    uuid = run_script(PROLOG, d, SLURM_JOB_ID="6", SLURM_JOB_GPUS="GPU-1234,0")
    assert uuid.returncode == 0 and "GPU-1234" in uuid.stderr and (d / "0").read_text() == "6\n"
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        r = run_script(PROLOG, readonly / "sub", SLURM_JOB_ID="7", SLURM_JOB_GPUS="0")
        if os.geteuid() != 0:  # root writes anyway: the point is the exit status
            assert "cannot create" in r.stderr
        assert r.returncode == 0
    finally:
        readonly.chmod(0o700)
    assert run_script(PROLOG, d, SLURM_JOB_ID="8").returncode == 0  # no GPUs: nothing, no error
    assert run_script(EPILOG, tmp_path / "never-made", SLURM_JOB_ID="8").returncode == 0


def test_concurrent_prologs_on_one_gpu_lose_no_job(tmp_path: Path) -> None:
    d = tmp_path / "map"
    jobs = [str(100 + i) for i in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: run_script(PROLOG, d, SLURM_JOB_ID=j, SLURM_JOB_GPUS="0"), jobs))
    assert all(r.returncode == 0 for r in results)
    assert sorted((d / "0").read_text().split()) == jobs
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda j: run_script(EPILOG, d, SLURM_JOB_ID=j), jobs[::2]))
    assert sorted((d / "0").read_text().split()) == jobs[1::2]


def _state(index: int, uuid: str, energy: float, processes: tuple[GPUProcess, ...] = ()) -> GPUState:
    ident = GPUIdentity(index, uuid, "NVIDIA H100 80GB HBM3", f"00000000:0{index}:00.0", "hopper", "9.0",
                        "counter", True)
    return GPUState(ident, True, GPUReading(0.0, processes=processes), energy, 0, 0.0)


def test_collector_splits_a_shared_gpu_by_the_sm_use_of_each_jobs_processes(tmp_path: Path) -> None:
    """Two jobs on one GPU (shards); NVML lists one process of each at 80% and 20% SM: the GPU's energy
    goes 80/20, each process found in its job through /proc/<pid>/cgroup (one job_<id> path, one Slurm
    26.05 SLUID path the prolog recorded)."""
    mapping, procfs = tmp_path / "map", tmp_path / "proc"
    (mapping / ".info").mkdir(parents=True)
    (mapping / "0").write_text("41\n42\n")
    (mapping / "1").write_text("43\n")
    (mapping / ".info" / "42").write_text("user=bob\nsluid=s5K1KKYAYG5D00\n")
    for pid, cg in ((101, "/system.slice/slurmstepd.scope/job_41/step_0/user/task_0"),
                    (202, "/system.slice/slurmstepd.scope/s5K1KKYAYG5D00/step_0/user/task_0"),
                    (303, "/user.slice/session-1.scope")):
        (procfs / str(pid)).mkdir(parents=True)
        (procfs / str(pid) / "cgroup").write_text(f"0::{cg}\n")
    procs = (GPUProcess(101, None, 80.0), GPUProcess(202, None, 20.0), GPUProcess(303, None, 50.0),
             GPUProcess(404, None, 10.0))  # 303: not a job; 404: no /proc entry (gone)
    energy = {"GPU-0": 1000.0, "GPU-1": 10.0}
    col = SlurmCollector(lambda: [_state(0, "GPU-0", energy["GPU-0"], procs), _state(1, "GPU-1", energy["GPU-1"])],
                         str(mapping), procfs=str(procfs), clock=lambda: 0.0)
    col.update()
    energy.update({"GPU-0": 1500.0, "GPU-1": 70.0})
    families = col.update()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    job = "gpuenergy_slurm_job_energy_joules_total"
    assert got[(job, (("job_id", "41"), ("method", "sm_utilization")))] == pytest.approx(400.0)
    assert got[(job, (("job_id", "42"), ("method", "sm_utilization")))] == pytest.approx(100.0)
    assert got[(job, (("job_id", "43"), ("method", "exclusive")))] == pytest.approx(60.0)
    assert got[("gpuenergy_slurm_job_mapping_available", ())] == 1.0
    info = {s.labels["job_id"]: s.labels["user"] for f in families for s in f.samples
            if s.name == "gpuenergy_slurm_job_info"}
    assert info == {"41": "", "42": "bob", "43": ""}
