"""GPU energy per Slurm job (``--collector.slurm``, off by default).

Reads the job-mapping directory (``--collector.slurm.job-mapping-dir``, dcgm-exporter's format, written
by the prolog and epilog in ``deploy/slurm/``) on the sampler thread, after the GPU collector, and charges
each GPU's energy delta to the jobs listed on it (``slurm.jobs``: exclusive, MIG instances, shared GPUs by
the SM utilisation of each job's processes, found through their cgroup in ``--path.procfs``, else
evenly). Never calls NVML: it reads the GPU collector's last states. Never puts a job label on a GPU
series: jobs get their own counters, which expire with the job, so series follow running jobs.

A job's edges are the mapping files' own modification times (``slurm.edges``), and the daemon reads every
energy counter as soon as the directory changes (``slurm.watch``); the job counters are settled at each
counter read (``slurm.jobs``), the part since in ``gpuenergy_slurm_job_energy_provisional_joules``.

A missing directory is "no job has started yet" (``gpuenergy_slurm_job_mapping_available 0``), not an
error; a malformed file loses only itself and is logged once.

The directory is read off the sampler thread (``core.tenantfiles.Watchdog``): a read stuck in the kernel
(a hung file system) costs the sample ``READ_TIMEOUT_S`` once, then nothing until it returns; meanwhile the
last mapping read is kept and ``gpuenergy_slurm_job_mapping_available`` is 0, as it is when the read was cut
by a bound (``slurm.mapping``: files, jobs, pairs). Jobs that held a GPU within the grace period are bounded
too (``slurm.jobs.MAX_JOBS``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.collectors.registry import CollectorSpec, Wiring, register
from gpu_energy_exporter.collectors.slurm.edges import MappingEdges, monotonic_cuts
from gpu_energy_exporter.collectors.slurm.jobs import JobEnergyAttributor, JobSlot
from gpu_energy_exporter.collectors.slurm.mapping import (
    JobInfo,
    JobMapping,
    job_of_cgroup,
    mapping_signature,
    read_mapping,
)
from gpu_energy_exporter.collectors.slurm.watch import dir_mtime
from gpu_energy_exporter.core.flagtypes import Flag, any_text
from gpu_energy_exporter.core.metrics import GPU_LABELS, add, define
from gpu_energy_exporter.core.ratelog import RateLimitedLog
from gpu_energy_exporter.core.state import GPUState, SlurmJob
from gpu_energy_exporter.core.tenantfiles import Stuck, TooLarge, Watchdog, read_regular

log = logging.getLogger(__name__)

JOB_ENERGY = define(
    "slurm", "job_energy_joules_total", "counter",
    "GPU energy charged to the Slurm job while it held GPUs on this node (from the prolog's write of the "
    "job-mapping file to the epilog's), since the exporter saw it, settled at each read of the GPU's energy "
    "counter (it lags by at most --collector.energy-interval; the part since is "
    "..._job_energy_provisional_joules). "
    "method: exclusive (whole GPU), mig_slices (MIG instances), sm_utilization or shared_even (GPU "
    "shared by several jobs). Sum over method (and over nodes) for the job's total.",
    ("job_id", "method"), collector="slurm", unit="joules",
)
JOB_PROVISIONAL = define(
    "slurm", "job_energy_provisional_joules", "gauge",
    "GPU energy charged to the Slurm job since its GPUs' energy counters were last read: the power readings' "
    "estimate, not settled yet. The next counter read (every --collector.energy-interval, and at every job "
    "start and end) settles it into ..._job_energy_joules_total and this gauge drops back.",
    ("job_id",), collector="slurm", unit="joules",
)
JOB_INFO = define(
    "slurm", "job_info", "info",
    "One series per Slurm job holding GPUs on this node, with what the prolog recorded (user, account, "
    "partition; empty when unknown). Join on job_id.",
    ("job_id", "user", "account", "partition"), collector="slurm",
)
GPU_JOB_INFO = define(
    "slurm", "gpu_job_info", "info",
    "Which job holds which GPU (instance: the MIG instance '<gpu>.<gpu instance>', empty for a whole "
    "GPU). Join on gpu_uuid to attribute any per-GPU series to jobs.",
    (*GPU_LABELS, "instance", "job_id"), collector="slurm",
)
UNATTRIBUTED_ENERGY = define(
    "slurm", "unattributed_energy_joules_total", "counter",
    "GPU energy consumed while no Slurm job held the GPU, since the slurm collector started (settled at each "
    "read of the GPU's energy counter, as the jobs' counters).",
    GPU_LABELS, collector="slurm", unit="joules",
)
MAPPING_AVAILABLE = define(
    "slurm", "job_mapping_available", "gauge",
    "1 if the job-mapping directory was read whole at the last sample; 0 if it is missing or unreadable, its "
    "read did not return in time (the last mapping read is kept), or it holds more files or jobs than the "
    "collector reads (the jobs read are charged).",
    (), collector="slurm",
)
#: How long a sample waits for the directory to be read, and for its signature (asked on the GPU
#: collector's thread at every sample: it must not wait long).
READ_TIMEOUT_S = 2.0
#: The files are read again when the GPU files changed (the prolog and epilog replace them) and at least this
#: often (a job's .info file written late), not at every sample.
REREAD_S = 30.0
SIGNATURE_TIMEOUT_S = 0.25


class SlurmCollector(Collector):
    """Per-job GPU energy from the job-mapping directory."""

    name = "slurm"
    depends_on = ("gpu",)

    def __init__(
        self,
        gpu_states: Callable[[], Sequence[GPUState]],
        mapping_dir: str,
        *,
        procfs: str = "/proc",
        series_grace_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        request_counter_read: Callable[[], None] | None = None,
        read: Callable[[str, Collection[int]], JobMapping] = read_mapping,
    ) -> None:
        """``request_counter_read``: ``GPUCollector.request_counter_read``, called when the directory
        changed after the GPU collector's check (``mapping_changed``) of the same sample. ``read``: how the
        directory is read (``slurm.mapping.read_mapping``; a test passes one that hangs)."""
        self._gpu_states = gpu_states
        self._dir = mapping_dir
        self._procfs = procfs
        self._clock = clock
        self._attributor = JobEnergyAttributor(series_grace_s)
        self._info: dict[str, JobInfo] = {}
        self._gpu_index: dict[str, str] = {}
        self._logged: frozenset[str] = frozenset()
        self._available_logged: bool | None = None
        self._read_sig: tuple[tuple[str, int, int], ...] = ()
        self._checked_sig: tuple[tuple[str, int, int], ...] = ()
        self._late_change = request_counter_read
        self._read = read
        self._held: tuple[SlurmJob, ...] | None = None
        self._edges = MappingEdges()  # when each job's hold began and ended (the files' mtimes)
        self._before: dict[str, tuple[JobSlot, ...]] = {}  # the last update's holders of each GPU
        self._reads = Watchdog("slurm-mapping-read", READ_TIMEOUT_S)
        self._signatures = Watchdog("slurm-mapping-check", SIGNATURE_TIMEOUT_S)
        self._mapping = JobMapping()
        self._read_at = -math.inf
        self._stuck_log = RateLimitedLog(log, period_s=300.0)
        self._problems_log = RateLimitedLog(log)
        self._cgroup_problem = RateLimitedLog(log, period_s=300.0)

    def held(self) -> tuple[SlurmJob, ...] | None:
        """The jobs holding GPUs at the last update (each GPU by its UUID, a MIG instance's UUID where the
        job holds an instance), for the run ledger (``Snapshot.slurm_jobs``); None until the first update
        and while the directory cannot be read."""
        return self._held

    @property
    def attributor(self) -> JobEnergyAttributor:
        return self._attributor

    def mapping_changed(self) -> bool:
        """For ``GPUCollector.add_counter_read_check``: True when the directory changed since this collector
        last read it, so the sample in which a job starts or ends reads the energy counters (the job's
        edges are then exact counter deltas, not energy apportioned between counter reads)."""
        try:
            self._checked_sig = self._signatures.call(mapping_signature, self._dir)
        except Stuck:
            return False  # the directory does not answer: the sample goes on
        return self._checked_sig != self._read_sig

    def update(self) -> list[Metric]:
        states = list(self._gpu_states())
        available = True
        try:
            sig = self._signatures.call(mapping_signature, self._dir)
            if sig != self._checked_sig and self._late_change is not None:
                # Rewritten between the GPU collector's check and now: this edge falls between counter reads;
                # read them at the next sample so the apportioned part stays within one interval.
                self._late_change()
            now = self._clock()
            if sig != self._read_sig or not sig or now - self._read_at >= REREAD_S or not self._mapping.available:
                self._mapping = self._reads.call(self._read, self._dir, {s.identity.index for s in states})
                self._read_at = now
            self._read_sig = self._checked_sig = sig
            mapping = self._mapping
        except Stuck as exc:
            self._stuck_log.warning("stuck", "Slurm job-mapping directory %s: %s; keeping the mapping read before "
                                    "(gpuenergy_slurm_job_mapping_available 0) until it answers", self._dir, exc)
            mapping, available, sig = self._mapping, False, self._read_sig
        self._log(mapping)
        by_index = {s.identity.index: s.identity.uuid for s in states}
        for s in states:
            self._gpu_index[s.identity.uuid] = str(s.identity.index)
        # (an unreadable directory is no edge: the next good read is compared with the last good one)
        changes = self._edges.update(sig, mapping, lambda: dir_mtime(self._dir), self._clock()) if (
            mapping.available and available) else {}
        holdings: dict[str, list[JobSlot]] = defaultdict(list)
        for (index, gi), jobs in mapping.gpus.items():
            uuid = by_index.get(index)
            if uuid is None:
                continue
            instance = f"{index}.{gi}" if gi is not None else ""
            holdings[uuid].extend(JobSlot(uuid, job, instance) for job in jobs)
        self._info.update(mapping.info)
        self._held = self._jobs(states, mapping) if mapping.available else None
        energy = {s.identity.uuid: s.energy_j for s in states if s.energy_j is not None}
        sm, owners = self._sm_weights(states, holdings, mapping)
        self._before = {uuid: tuple(slots) for uuid, slots in holdings.items()}
        offsets = {s.identity.index: (s.identity.uuid, s.reading.timestamp - s.read_at) for s in states
                   if s.reading is not None and s.read_at is not None}
        self._attributor.update(self._clock(), energy, holdings, sm, states={s.identity.uuid: s for s in states},
                                cuts=monotonic_cuts(changes, offsets), owners=owners)
        live = self._attributor.jobs()
        self._info = {job: info for job, info in self._info.items() if job in live}
        return self._families(holdings, available and mapping.available and mapping.complete)

    def _jobs(self, states: Sequence[GPUState], mapping: JobMapping) -> tuple[SlurmJob, ...]:
        gpus: dict[str, list[str]] = defaultdict(list)
        for s in states:
            for (index, gi), jobs in mapping.gpus.items():
                if index != s.identity.index:
                    continue
                uuid = s.identity.uuid
                if gi is not None:  # the MIG instance's own UUID, so the ledger splits the GPU by slices
                    uuid = next((m.uuid for m in s.identity.mig_devices if m.gpu_instance_id == gi), uuid)
                for job in jobs:
                    if uuid not in gpus[job]:
                        gpus[job].append(uuid)
        out = []
        for job in sorted(gpus):
            i = mapping.info.get(job) or self._info.get(job) or JobInfo(job)
            out.append(SlurmJob(job, tuple(gpus[job]), i.user, i.account, i.partition,
                                since=self._edges.since.get(job)))
        # Jobs that ended lately, with the epilog's time (the run ledger ends their runs there).
        out.extend(SlurmJob(job, (), until=until) for job, (until, _) in sorted(self._edges.ended.items())
                   if until is not None and job not in gpus)
        return tuple(out)

    def _sm_weights(
        self, states: Sequence[GPUState], holdings: dict[str, list[JobSlot]], mapping: JobMapping
    ) -> tuple[dict[str, dict[str, float]], dict[str, dict[int, str]]]:
        """GPU UUID -> job -> SM utilisation of the job's processes, for whole GPUs several jobs share; and
        GPU UUID -> pid -> job of those processes (maps the per-process samples when a piece settles)."""
        sluids = {i.sluid: job for job, i in mapping.info.items() if i.sluid}
        out: dict[str, dict[str, float]] = {}
        owners: dict[str, dict[int, str]] = {}
        for s in states:
            slots = holdings.get(s.identity.uuid, ())
            # (the jobs before this sample's change too: the piece before the edge is theirs)
            jobs = {slot.job_id for slot in (*slots, *self._before.get(s.identity.uuid, ())) if not slot.instance}
            if len(jobs) < 2 or s.reading is None or not s.reading.processes:
                continue
            w: dict[str, float] = defaultdict(float)
            placed: dict[int, str] = {}
            owners[s.identity.uuid] = placed
            for p in s.reading.processes:
                job = self._job_of_pid(p.pid, sluids)
                if job is None or job not in jobs:
                    continue
                placed[p.pid] = job
                if p.sm_util_pct is not None:
                    w[job] += p.sm_util_pct
            if w:
                out[s.identity.uuid] = dict(w)
        return out, owners

    def _job_of_pid(self, pid: int, sluids: dict[str, str]) -> str | None:
        try:
            text = read_regular(os.path.join(self._procfs, str(pid), "cgroup"), 64 * 1024)
        except FileNotFoundError:
            return None  # gone, or another pid namespace: the job keeps an even share
        except (OSError, TooLarge) as exc:
            self._cgroup_problem.warning("cgroup", "cannot read %s/%d/cgroup (%s); that process's job keeps an even "
                                         "share", self._procfs, pid, exc)
            return None
        return job_of_cgroup(text.decode("utf-8", "replace"), sluids)

    def _families(self, holdings: dict[str, list[JobSlot]], available: bool) -> list[Metric]:
        gpu_job = GPU_JOB_INFO.family()
        for uuid in sorted(holdings):
            for slot in sorted(set(holdings[uuid])):
                add(gpu_job, [], {"gpu": self._gpu_index.get(uuid, ""), "gpu_uuid": uuid,
                                  "instance": slot.instance, "job_id": slot.job_id})
        info = JOB_INFO.family()
        for job in sorted(self._attributor.jobs()):
            i = self._info.get(job, JobInfo(job))
            add(info, [], {"job_id": job, "user": i.user, "account": i.account, "partition": i.partition})
        energy = JOB_ENERGY.family()
        for (job, method), joules in sorted(self._attributor.job_energy().items()):
            add(energy, [job, method], joules)
        provisional = JOB_PROVISIONAL.family()
        for job, joules in sorted(self._attributor.job_provisional().items()):
            add(provisional, [job], joules)
        unattributed = UNATTRIBUTED_ENERGY.family()
        for uuid, joules in sorted(self._attributor.unattributed_energy().items()):
            add(unattributed, [self._gpu_index.get(uuid, ""), uuid], joules)
        up = MAPPING_AVAILABLE.family()
        add(up, [], 1.0 if available else 0.0)
        return [gpu_job, info, energy, provisional, unattributed, up]

    def _log(self, mapping: JobMapping) -> None:
        if mapping.available != self._available_logged:
            if not mapping.available:
                log.info("Slurm job-mapping directory %s is missing or unreadable: no job energy until the "
                         "prolog (deploy/slurm/) writes it%s", self._dir,
                         f" ({mapping.problems[0]})" if mapping.problems else "")
            self._available_logged = mapping.available
        problems = frozenset(mapping.problems)
        new = problems - self._logged
        if new and mapping.available:
            # a writer can make new problems at every sample: a line a minute, the rest counted
            self._problems_log.warning("skipped", "Slurm job-mapping directory %s: skipped %s", self._dir,
                                       "; ".join(sorted(new))[:2000])
        self._logged = problems


def _build(w: Wiring) -> SlurmCollector:
    gpu: Any = w.require("gpu", "slurm")
    directory = w.config.collector_slurm_job_mapping_dir
    slurm = SlurmCollector(gpu.states, directory, procfs=w.config.path_procfs,
                           request_counter_read=gpu.request_counter_read)
    # A job's start and end fall on energy-counter reads (docs/slurm.md): read at once when the directory
    # changes (the watch), and in any sample that finds it changed.
    gpu.add_counter_read_check(slurm.mapping_changed)
    w.sampler_hooks["slurm_jobs"] = slurm.held  # Slurm jobs are runs (ledger.jobs)
    from gpu_energy_exporter.collectors.slurm.watch import DirectoryWatch

    w.services.append(DirectoryWatch(directory, w.read_counters_now))
    return slurm


register(CollectorSpec(
    "slurm", False, "GPU energy per Slurm job from the prolog's job-mapping directory.", order=60, build=_build,
    title="Slurm jobs (collector `slurm`)",
    flags=(Flag("collector.slurm.job-mapping-dir", any_text, "/run/gpu-energy-exporter/slurm-jobs",
                "Directory the Slurm prolog/epilog keep (dcgm-exporter's DCGM_HPC_JOB_MAPPING_DIR format: one file "
                "per GPU index, or '<index>.<gpu instance>' for MIG, listing job ids) for --collector.slurm.",
                "DIR"),),
))
