"""The Slurm job-mapping directory and job cgroup paths, parsed.

The directory is dcgm-exporter's format (``DCGM_HPC_JOB_MAPPING_DIR``), so one prolog/epilog pair can
feed both exporters: one file per GPU, named by the GPU's index (``0``, ``1``, ...) or, for a MIG
instance, ``<gpu index>.<gpu instance id>``, each holding the ids of the jobs that use it, one per
line. Our own prolog (``deploy/slurm/``) also writes ``.info/<job id>`` with ``key=value`` lines (user,
account, partition, SLUID) that dcgm-exporter ignores (it skips directories and non-numeric names).

This module never reads a clock and never raises on bad content: a malformed line or an unreadable
file is skipped and named in ``JobMapping.problems``, so one stray file loses only itself.

Whoever can write the directory (a prolog, and on some sites a tenant) chooses what is in it, so every
file is opened without blocking and read only if it is a regular file (``core.tenantfiles.read_regular``:
a FIFO at ``.info/<job>`` used to block the collector in ``open()`` for ever), and what a read can make is
bounded in total: ``MAX_ENTRIES`` directory entries looked at (in directory order, then sorted), the GPU
files of GPUs this node has (``gpus``), ``MAX_JOBS_PER_GPU`` jobs a file, ``MAX_HOLDINGS`` (GPU, job) pairs
and ``MAX_JOBS`` jobs in all. A read cut by a bound is ``complete=False``, with the bound in ``problems``.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from gpu_energy_exporter.core.tenantfiles import read_regular

#: A GPU file's name: the GPU index, or ``index.gpu_instance_id`` for a MIG instance.
GPU_FILE = re.compile(r"^(\d{1,4})(?:\.(\d{1,4}))?$")
#: A Slurm job id, with an array or heterogeneous-job suffix (``123``, ``123_4``, ``123+1``).
JOB_ID = re.compile(r"^\d{1,12}(?:[_+]\d{1,12})?$")
INFO_DIR = ".info"
INFO_KEYS = ("user", "account", "partition", "sluid")
#: Bounds: what one hostile or broken file can cost (a GPU file lists a few jobs at most), and what the
#: directory can in all (a node of 8 GPUs of 7 MIG instances has 64 GPU files; every series of the slurm
#: collector is one of a (GPU, job) pair or of a job).
MAX_FILE_BYTES = 64 * 1024
MAX_JOBS_PER_GPU = 256
MAX_ENTRIES = 4096
MAX_HOLDINGS = 4096
MAX_JOBS = 1024
#: Kept for callers of the former name: the entries looked at.
MAX_FILES = MAX_ENTRIES
_INFO_VALUE = re.compile(r"^[A-Za-z0-9._@+-]{0,128}$")


@dataclass(frozen=True)
class JobInfo:
    """What the prolog recorded about a job (empty strings when unknown)."""

    job_id: str
    user: str = ""
    account: str = ""
    partition: str = ""
    sluid: str = ""


@dataclass(frozen=True)
class JobMapping:
    """One read of the directory. ``gpus``: (GPU index, MIG GPU instance id or None) -> job ids.
    ``available``: the directory exists and could be listed. ``problems``: one short text per skipped
    file or line."""

    gpus: dict[tuple[int, int | None], tuple[str, ...]] = field(default_factory=dict)
    info: dict[str, JobInfo] = field(default_factory=dict)
    available: bool = False
    problems: tuple[str, ...] = ()
    complete: bool = True  # False: a bound cut the read (named in problems)


def _read_bounded(path: Path) -> str:
    return read_regular(path, MAX_FILE_BYTES).decode("utf-8", errors="replace")


def _why(exc: Exception) -> str:
    return str(getattr(exc, "strerror", None) or exc)


def read_mapping(directory: str | os.PathLike[str], gpus: Collection[int] | None = None) -> JobMapping:
    """Read the job-mapping directory (``gpus``: the GPU indices whose files are read; None: every one). A
    missing directory is ``available=False`` with no problem (no job has run yet, or the prolog is not
    installed); anything else wrong is a problem, not an error."""
    root = Path(directory)
    problems: list[str] = []
    complete = True
    try:
        with os.scandir(root) as it:
            entries = list(itertools.islice(it, MAX_ENTRIES + 1))
    except FileNotFoundError:
        return JobMapping()
    except OSError as exc:
        return JobMapping(problems=(f"{root}: {exc.strerror or exc}",))
    if len(entries) > MAX_ENTRIES:
        entries = entries[:MAX_ENTRIES]
        complete = False
        problems.append(f"more than {MAX_ENTRIES} entries: the rest are not read")
    held: dict[tuple[int, int | None], tuple[str, ...]] = {}
    holdings = 0
    cut = False
    jobs_seen: set[str] = set()
    for entry in sorted(entries, key=lambda e: e.name):
        m = GPU_FILE.match(entry.name)
        if m is None or (gpus is not None and int(m.group(1)) not in gpus):
            continue  # .info, .lock, temp files, another tool's files, a GPU this node does not have
        if cut:
            break  # full: the other files are not opened
        try:
            text = _read_bounded(Path(entry.path))
        except (OSError, ValueError) as exc:
            problems.append(f"{entry.name}: {_why(exc)}")
            continue
        jobs: list[str] = []
        for line in text.splitlines():
            job = line.strip()
            if not job:
                continue
            if not JOB_ID.match(job):
                problems.append(f"{entry.name}: not a job id: {job[:40]!r}")
                continue
            if job in jobs or len(jobs) >= MAX_JOBS_PER_GPU:
                continue
            if holdings >= MAX_HOLDINGS or (job not in jobs_seen and len(jobs_seen) >= MAX_JOBS):
                cut = True
                continue
            jobs.append(job)
            jobs_seen.add(job)
            holdings += 1
        if jobs:
            gi = m.group(2)
            held[(int(m.group(1)), int(gi) if gi is not None else None)] = tuple(jobs)
    if cut:
        complete = False
        problems.append(f"more than {MAX_HOLDINGS} (GPU, job) pairs or {MAX_JOBS} jobs: the rest are not read")
    return JobMapping(held, _read_info(root / INFO_DIR, jobs_seen, problems), True, tuple(problems), complete)


def _read_info(directory: Path, jobs: set[str], problems: list[str]) -> dict[str, JobInfo]:
    out: dict[str, JobInfo] = {}
    for job in sorted(jobs):
        try:
            text = _read_bounded(directory / job)
        except FileNotFoundError:
            out[job] = JobInfo(job)
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{INFO_DIR}/{job}: {_why(exc)}")
            out[job] = JobInfo(job)
            continue
        values: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            key, value = key.strip(), value.strip()
            if sep and key in INFO_KEYS and _INFO_VALUE.match(value):
                values[key] = value
        out[job] = JobInfo(job, **values)
    return out


def mapping_signature(directory: str | os.PathLike[str]) -> tuple[tuple[str, int, int], ...]:
    """What changes when the prolog or epilog rewrites the directory: each GPU file's and each ``.info`` file's
    name, inode and modification time (the scripts replace files by rename; a prolog that writes a job's
    info after its GPU files, as ours did, changes the signature again, so the info is read). Two scandirs, no
    file read: cheap enough to ask at every sample."""
    out: list[tuple[str, int, int]] = []
    try:
        with os.scandir(directory) as it:
            for entry in itertools.islice(it, MAX_ENTRIES):
                if GPU_FILE.match(entry.name):
                    st = entry.stat(follow_symlinks=False)
                    out.append((entry.name, st.st_ino, st.st_mtime_ns))
    except OSError:
        return ()
    try:
        with os.scandir(os.path.join(directory, INFO_DIR)) as it:
            for entry in itertools.islice(it, MAX_ENTRIES):
                if not entry.name.startswith("."):
                    st = entry.stat(follow_symlinks=False)
                    out.append((INFO_DIR + "/" + entry.name, st.st_ino, st.st_mtime_ns))
    except OSError:
        pass  # no .info directory: another tool's prolog, or none yet
    return tuple(sorted(out))


# Slurm job cgroups. v1: .../slurm[_<node>]/uid_<uid>/job_<id>/...; v2: .../[<node>_]slurmstepd.scope/
# job_<id>/... and, from Slurm 26.05, .../slurmstepd.scope/<SLUID>/... (CgroupJobIdPaths=yes restores
# job_<id>). A SLUID is "s" and 13 base-32 characters; the prolog records it so it maps to the job id.
_CGROUP_V1 = re.compile(r"/slurm(?:_[^/]+)?/uid_\d+/job_(\d+)(?:/|$)")
_CGROUP_V2 = re.compile(r"/(?:[^/]+_)?slurmstepd\.scope/(?:job_(\d+)|(s[0-9A-Z]{13}))(?:/|$)")


def job_of_cgroup(cgroup_file: str, sluids: dict[str, str] | None = None) -> str | None:
    """The Slurm job id a process belongs to, from the text of its ``/proc/<pid>/cgroup``; None when it
    is not in a job (or in a SLUID-named cgroup whose job the prolog did not record)."""
    for line in cgroup_file.splitlines():
        path = line.split(":", 2)[-1]
        m = _CGROUP_V1.search(path)
        if m:
            return m.group(1)
        m = _CGROUP_V2.search(path)
        if m:
            if m.group(1):
                return m.group(1)
            return (sluids or {}).get(m.group(2))
    return None
