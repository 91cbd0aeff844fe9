"""The Slurm job-mapping directory and job cgroup paths, parsed.

The directory is dcgm-exporter's format (``DCGM_HPC_JOB_MAPPING_DIR``), so one prolog/epilog pair can
feed both exporters: one file per GPU, named by the GPU's index (``0``, ``1``, ...) or, for a MIG
instance, ``<gpu index>.<gpu instance id>``, each holding the ids of the jobs that use it, one per
line. Our own prolog (``deploy/slurm/``) also writes ``.info/<job id>`` with ``key=value`` lines (user,
account, partition, SLUID) that dcgm-exporter ignores (it skips directories and non-numeric names).

This module never reads a clock and never raises on bad content: a malformed line or an unreadable
file is skipped and named in ``JobMapping.problems``, so one stray file loses only itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

#: A GPU file's name: the GPU index, or ``index.gpu_instance_id`` for a MIG instance.
GPU_FILE = re.compile(r"^(\d{1,4})(?:\.(\d{1,4}))?$")
#: A Slurm job id, with an array or heterogeneous-job suffix (``123``, ``123_4``, ``123+1``).
JOB_ID = re.compile(r"^\d{1,12}(?:[_+]\d{1,12})?$")
INFO_DIR = ".info"
INFO_KEYS = ("user", "account", "partition", "sluid")
#: Bounds: what one hostile or broken file can cost (a GPU file lists a few jobs at most).
MAX_FILE_BYTES = 64 * 1024
MAX_JOBS_PER_GPU = 256
MAX_FILES = 4096
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


def _read_bounded(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


def read_mapping(directory: str | os.PathLike[str]) -> JobMapping:
    """Read the job-mapping directory. A missing directory is ``available=False`` with no problem (no
    job has run yet, or the prolog is not installed); anything else wrong is a problem, not an error."""
    root = Path(directory)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)[:MAX_FILES]
    except FileNotFoundError:
        return JobMapping()
    except OSError as exc:
        return JobMapping(problems=(f"{root}: {exc.strerror or exc}",))
    gpus: dict[tuple[int, int | None], tuple[str, ...]] = {}
    problems: list[str] = []
    for entry in entries:
        m = GPU_FILE.match(entry.name)
        if m is None:
            continue  # .info, .lock, temp files, another tool's files
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            text = _read_bounded(Path(entry.path))
        except (OSError, ValueError) as exc:
            problems.append(f"{entry.name}: {getattr(exc, 'strerror', None) or exc}")
            continue
        jobs: list[str] = []
        for line in text.splitlines():
            job = line.strip()
            if not job:
                continue
            if not JOB_ID.match(job):
                problems.append(f"{entry.name}: not a job id: {job[:40]!r}")
                continue
            if job not in jobs and len(jobs) < MAX_JOBS_PER_GPU:
                jobs.append(job)
        if jobs:
            gi = m.group(2)
            gpus[(int(m.group(1)), int(gi) if gi is not None else None)] = tuple(jobs)
    held = {job for jobs in gpus.values() for job in jobs}
    return JobMapping(gpus, _read_info(root / INFO_DIR, held), True, tuple(problems))


def _read_info(directory: Path, jobs: set[str]) -> dict[str, JobInfo]:
    out: dict[str, JobInfo] = {}
    for job in sorted(jobs):
        try:
            text = _read_bounded(directory / job)
        except (OSError, ValueError):
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
    """What changes when the prolog or epilog rewrites the directory: each GPU file's name, inode and
    modification time (the scripts replace files by rename). One scandir, no file read: cheap enough to
    ask at every sample."""
    try:
        with os.scandir(directory) as it:
            out = []
            for entry in it:
                if GPU_FILE.match(entry.name):
                    st = entry.stat(follow_symlinks=False)
                    out.append((entry.name, st.st_ino, st.st_mtime_ns))
    except OSError:
        return ()
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
