"""Pods and Slurm jobs on the frozen-clock node of ``settle_rig`` (issue 28): the same fake NVML library, GPU
collector, sampler and run ledger, plus the real slurm collector reading a job-mapping directory and the real
kubernetes collector asking a real gRPC kubelet stand-in (``kubernetes.testing.FakeKubelet``), wired as the
daemon wires them (``daemon/exporter.py``): a change of the job-mapping directory (the real watch,
``slurm.watch``, on its thread) or of the kubelet's answer (``PodResourcesWatcher.on_change``) reads every
energy counter in a sample taken at once, ``EDGE_LATENCY_S`` later on the frozen clock (the rig waits, in real
time, until the watch has asked for that sample).

A job's prolog and epilog are file writes dated with ``os.utime`` at the exact instant of the scenario (the
file's mtime is the job's edge); a pod's start and stop are kubelet answers at a refresh taken at that instant.
Where the package has no watch or no such callbacks (the code before issue 28's edges), the rig wires what
there is: the edge is then seen by the next regular sample, as the daemon saw it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from settle_rig import EDGE_LATENCY_S, INTERVAL, Node

from gpu_energy_exporter.collectors.kubernetes.assignments import PodRef
from gpu_energy_exporter.collectors.kubernetes.collector import KubernetesCollector
from gpu_energy_exporter.collectors.slurm.collector import SlurmCollector
from gpu_energy_exporter.engine.sampler import Sampler

__all__ = ["EDGE_LATENCY_S", "MemberNode"]


class MemberNode(Node):
    """``settle_rig.Node`` with the slurm collector on ``tmp/slurm-jobs`` (``job_pids``: pid -> the job whose
    cgroup it runs in) and, with ``kubelet_socket``, the kubernetes collector (``owners``: pid -> container,
    what ``ProcfsPods`` finds on a node)."""

    def __init__(self, lib: Path, tmp: Path, gpus: Sequence[Any], *, kubelet_socket: str | None = None,
                 owners: Mapping[int, PodRef] | None = None, job_pids: Mapping[int, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(lib, tmp, gpus, **kwargs)
        for pid, job in (job_pids or {}).items():  # processes in Slurm job cgroups (cgroup v2)
            (tmp / "proc" / str(pid) / "cgroup").write_text(
                f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n")
        self.mapping = tmp / "slurm-jobs"
        self.mapping.mkdir()
        clock = self.clock
        self.slurm = SlurmCollector(self.gpu.states, str(self.mapping), procfs=str(tmp / "proc"), clock=clock,
                                    request_counter_read=self.gpu.request_counter_read)
        self.gpu.add_counter_read_check(self.slurm.mapping_changed)
        self.watch: Any = None
        try:
            from gpu_energy_exporter.collectors.slurm.watch import DirectoryWatch
        except ImportError:
            pass  # before the watch: the next sample sees the directory changed
        else:
            self.watch = DirectoryWatch(str(self.mapping), self.read_counters_now)
            self.watch.start()
        collectors: list[Any] = [self.gpu, self.slurm]
        self.k8s: KubernetesCollector | None = None
        self.watcher: Any = None
        if kubelet_socket is not None:
            from gpu_energy_exporter.collectors.kubernetes.podresources import PodResourcesWatcher

            known = dict(owners or {})
            try:
                self.watcher = PodResourcesWatcher(kubelet_socket, 3600.0, clock=clock,
                                                   on_change=self.read_counters_now)
                self.k8s = KubernetesCollector(self.gpu.states, self.watcher, clock=clock,
                                               pid_to_pod=lambda pid, cands: known.get(pid),
                                               request_counter_read=self.read_counters_now)
            except TypeError:  # before issue 28's pod edges: no callbacks
                self.watcher = PodResourcesWatcher(kubelet_socket, 3600.0, clock=clock)
                self.k8s = KubernetesCollector(self.gpu.states, self.watcher, clock=clock,
                                               pid_to_pod=lambda pid, cands: known.get(pid))
            collectors.append(self.k8s)
        self.sampler = Sampler(collectors, INTERVAL, gpu_states=self.gpu.states, clock=clock, monotonic=clock,
                               wait_budget=30.0, slurm_jobs=self.slurm.held)
        self.sampler.add_listener(self.ledger.on_snapshot)

    def read_counters_now(self) -> None:
        """``Exporter.read_counters_now``."""
        self.gpu.request_counter_read()
        self.sampler.sample_soon()

    def ticks_until(self, t: float) -> None:
        """The regular samples up to (not at) ``t``."""
        while self.next_tick < t - 1e-9:
            self.sample_at(self.next_tick)
            self.next_tick += INTERVAL

    def at(self, t: float, edge: Callable[[], None]) -> None:
        """The regular samples before ``t``, then ``edge`` happens at ``t`` and the sample it asked for."""
        self.ticks_until(t)
        self.now = t
        edge()
        self.early_sample()

    # ---- Slurm: the prolog and the epilog

    def _write(self, name: str, jobs: Sequence[str], t: float) -> None:
        """The GPU file ``name`` now lists ``jobs`` (removed when none), written at ``t`` as the scripts do
        (temp file and rename): the file's mtime is ``t``, and the directory's (a removal's edge) too."""
        path = self.mapping / name
        if jobs:
            tmp = self.mapping / f".tmp.{name}"
            tmp.write_text("".join(f"{j}\n" for j in jobs))
            os.utime(tmp, ns=(int(t * 1e9), int(t * 1e9)))
            tmp.rename(path)
        else:
            path.unlink()
        os.utime(self.mapping, ns=(int(t * 1e9), int(t * 1e9)))

    def listed(self, name: str) -> list[str]:
        path = self.mapping / name
        return path.read_text().split() if path.exists() else []

    def _watched(self) -> None:
        """Wait (real time) until the directory watch has asked for the early sample."""
        if self.watch is None:
            return
        deadline = time.monotonic() + 10.0
        while not self.sampler.soon_pending():
            assert time.monotonic() < deadline, "the job-mapping directory watch did not see the change"
            time.sleep(0.001)

    def prolog(self, job: str, t: float, gpus: Sequence[int] = (0,)) -> None:
        """Job ``job`` starts on ``gpus`` at ``t``: the prolog writes their files; the watch sees it."""
        def write() -> None:
            for g in gpus:
                self._write(str(g), [*self.listed(str(g)), job], t)
            self._watched()
        self.at(t, write)

    def epilog(self, job: str, t: float) -> None:
        """Job ``job`` ends at ``t``: the epilog takes it out of every file (removing a file left empty)."""
        def write() -> None:
            for path in sorted(self.mapping.iterdir()):
                if not path.name.startswith(".") and job in self.listed(path.name):
                    self._write(path.name, [j for j in self.listed(path.name) if j != job], t)
            self._watched()
        self.at(t, write)

    def job_energy(self, job: str) -> float:
        """The slurm collector's settled counter of ``job`` (summed over methods)."""
        return sum(j for (job_id, _), j in self.slurm.attributor.job_energy().items() if job_id == job)

    # ---- Kubernetes: the kubelet's answer changes at a refresh

    def refresh(self, t: float, kubelet: Any, pods: Sequence[Any]) -> None:
        """At ``t`` the kubelet answers ``pods`` to the watcher's refresh (it calls ``on_change``)."""
        def answer() -> None:
            kubelet.set_pods(list(pods))
            self.watcher.refresh()
        self.at(t, answer)

    def pod_energy(self, namespace: str, pod: str) -> float:
        assert self.k8s is not None
        return sum(j for (ns, name, _), j in self.k8s.attributor.pod_energy().items() if (ns, name) == (namespace, pod))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.k8s is not None:
            self.k8s.close()
        super().close()
