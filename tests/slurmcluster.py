"""A real one-node Slurm on loopback for the tests: munged, slurmctld and slurmd (Debian's slurm-wlm),
GPUs declared as gres over stand-in device files, and the project's shipped prolog and epilog.

Everything lives in one temporary directory: its own slurm.conf, munge key and socket, state, spool and
logs, and free loopback ports, so it never touches a Slurm the machine may run. The daemons run in the
foreground as children of the test and are stopped at teardown.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from helpers import free_port

REPO = Path(__file__).resolve().parent.parent
PROLOG = REPO / "deploy" / "slurm" / "gpu-energy-prolog.sh"
EPILOG = REPO / "deploy" / "slurm" / "gpu-energy-epilog.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``gpus`` GPUs (gres ``gpu``, plus ``shard`` gres so two jobs can share one GPU) on one node."""

    def __init__(self, root: Path, mapping_dir: Path, gpus: int = 2, shards_per_gpu: int = 2) -> None:
        self.root = root
        self.mapping_dir = mapping_dir
        self.gpus = gpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._shards = shards_per_gpu

    def _write(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge", "dev", "jobs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        for i in range(self.gpus):
            dev = r / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))  # a character device, as slurmd wants
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for name, script in (("prolog", PROLOG), ("epilog", EPILOG)):
            w = r / f"{name}.sh"
            w.write_text(f"#!/bin/sh\nexport GPU_ENERGY_JOB_MAPPING_DIR='{self.mapping_dir}'\n"
                         f"date +%s.%N > '{r}/log/{name}.$SLURM_JOB_ID'\nexec sh '{script}'\n")
            w.chmod(0o755)
        devs = f"{r}/dev/nvidia[0-{self.gpus - 1}]"
        self.conf.write_text("\n".join([
            "ClusterName=gpuenergytest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r}/munge/munge.socket",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu,shard",
            f"Prolog={r}/prolog.sh",
            f"Epilog={r}/epilog.sh",
            "PrologFlags=Alloc",
            "ReturnToService=2",
            "MpiDefault=none",
            "SchedulerParameters=sched_interval=1",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 "
            f"Gres=gpu:{self.gpus},shard:{self.gpus * self._shards} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        (r / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File={devs}\n"
            f"NodeName={self.node} Name=shard Count={self.gpus * self._shards} File={devs}\n")

    def start(self) -> SlurmCluster:
        self._write()
        r = self.root
        log = open(r / "log" / "daemons.out", "ab")  # noqa: SIM115 - closed with the processes
        self._log = log
        self._procs.append(subprocess.Popen(
            [_bin("munged"), "-F", f"--socket={r}/munge/munge.socket", f"--key-file={r}/munge/munge.key",
             f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed",
             "--force"], stdout=log, stderr=log))
        self._wait(lambda: (r / "munge" / "munge.socket").exists(), "munged's socket")
        self._procs.append(subprocess.Popen([_bin("slurmctld"), "-D", "-c", "-f", str(self.conf)],
                                            stdout=log, stderr=log, env=self.env))
        self._procs.append(subprocess.Popen([_bin("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)],
                                            stdout=log, stderr=log, env=self.env))
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%t", check=False).strip() == "idle",
                   "the node to register idle", timeout=60)
        return self

    def _wait(self, ok: object, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(ok) and ok():
                return
            if any(p.poll() is not None for p in self._procs):
                break
            time.sleep(0.2)
        raise AssertionError(f"Slurm did not start ({what}):\n{self.logs()}")

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run([_bin(cmd[0]), *cmd[1:]], env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed: {done.stderr}\n{self.logs()}")
        return done.stdout

    def sbatch(self, *args: str, wrap: str) -> str:
        """Submit a batch job; its id."""
        return self.run("sbatch", "--parsable", "-o", str(self.root / "jobs" / "%j.out"), *args,
                        "--wrap", wrap).strip().split(";")[0]

    def state(self, job: str) -> str:
        return self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()

    def prolog_time(self, job: str, which: str = "prolog") -> float | None:
        p = self.root / "log" / f"{which}.{job}"
        return float(p.read_text()) if p.exists() else None

    def logs(self) -> str:
        out = []
        for name in ("daemons.out", "slurmctld.log", "slurmd.log", "munged.log"):
            p = self.root / "log" / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if hasattr(self, "_log"):
            self._log.close()
