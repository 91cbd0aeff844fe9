"""When a Slurm job's hold on a GPU began and ended: the job-mapping files' own modification times.

The prolog writes a GPU's file when a job starts on it, the epilog rewrites it (or removes it, the last job
gone) when the job ends (``deploy/slurm/``). The time of that write is the job's edge on that GPU, to the
file system's clock granularity: not the next sample that reads the directory (up to an interval later,
a second of a 10 s job). ``MappingEdges`` follows the directory's signature (``mapping.mapping_signature``:
each GPU file's name, inode and mtime) from one read to the next and says, per GPU, when its holders
changed (the file's mtime; a removed file: the directory's mtime, which the removal set), and per job when
it was first listed and when it stopped being listed. The times are wall-clock seconds (the file system's);
``on_monotonic`` places one on the GPU readings' monotonic clock.

Pure bookkeeping on values the collector passes in (signatures, mappings, the directory's mtime): no I/O,
no clock. It must never decide who holds a GPU (the mapping does) nor change how the directory is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpu_energy_exporter.collectors.slurm.mapping import GPU_FILE, JobMapping

#: An ended job's edge is kept this long (seconds on the collector's clock) for the snapshots that follow.
ENDED_KEEP_S = 60.0

Signature = Sequence[tuple[str, int, int]]  # (file name, inode, mtime ns), as mapping_signature returns it


def gpu_of_file(name: str) -> int | None:
    """The GPU index a job-mapping file is for (``3`` and ``3.1`` are GPU 3), None for another file."""
    m = GPU_FILE.match(name)
    return int(m.group(1)) if m else None


@dataclass
class MappingEdges:
    """Per GPU and per job, the wall-clock time of the last change of the job-mapping directory."""

    #: job id -> when it was first listed (wall seconds), for the jobs listed now (None: present at start)
    since: dict[str, float | None] = field(default_factory=dict)
    #: job id -> (when it stopped being listed, the collector's clock then) for jobs that ended lately
    ended: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    _sig: dict[str, tuple[int, int]] | None = None  # the last signature read: name -> (inode, mtime ns)
    _files: dict[str, tuple[str, ...]] = field(default_factory=dict)  # job -> GPU files listing it last time

    def update(self, sig: Signature, mapping: JobMapping, dir_mtime: Callable[[], float | None],
               now: float) -> dict[int, float]:
        """One read of the directory (``sig`` taken before ``mapping`` was read; ``dir_mtime()``: the
        directory's mtime in wall seconds, asked only when a file was removed; ``now``: the collector's
        clock, for how long ended jobs are kept). Returns GPU index -> when its holders changed (wall
        seconds), for the GPUs whose files changed since the last read; nothing at the first read (the jobs
        found then were there before the exporter)."""
        new = {name: (ino, mtime) for name, ino, mtime in sig}
        changed: dict[str, float] = {}
        if self._sig is not None:
            removed_at: float | None = None
            for name, (ino, mtime) in new.items():
                if self._sig.get(name) != (ino, mtime):
                    changed[name] = mtime / 1e9
            for name in self._sig.keys() - new.keys():
                if removed_at is None:
                    removed_at = dir_mtime()
                if removed_at is not None:
                    changed[name] = removed_at
        first = self._sig is None
        self._sig = new
        files = _files_of(mapping)
        for job, names in files.items():
            if job not in self.since:
                times = [changed[n] for n in names if n in changed]
                self.since[job] = None if first or not times else min(times)
                self.ended.pop(job, None)
        for job in [j for j in self.since if j not in files]:
            del self.since[job]
            times = [changed[n] for n in self._files.get(job, ()) if n in changed]
            self.ended[job] = (max(times) if times else None, now)
        self._files = files
        for job in [j for j, (_, seen) in self.ended.items() if now - seen > ENDED_KEEP_S]:
            del self.ended[job]
        out: dict[int, float] = {}
        for name, t in changed.items():
            index = gpu_of_file(name)
            if index is not None:
                out[index] = max(t, out.get(index, t))
        return out


def _files_of(mapping: JobMapping) -> dict[str, tuple[str, ...]]:
    """job id -> the names of the GPU files that list it."""
    out: dict[str, list[str]] = {}
    for (index, gi), jobs in mapping.gpus.items():
        name = str(index) if gi is None else f"{index}.{gi}"
        for job in jobs:
            out.setdefault(job, []).append(name)
    return {job: tuple(names) for job, names in out.items()}


def on_monotonic(wall_s: float, offset_s: float) -> float:
    """A wall-clock time on the monotonic clock whose readings are ``offset_s`` behind the wall clock
    (``GPUReading.timestamp - GPUState.read_at``)."""
    return wall_s - offset_s


def monotonic_cuts(changes: Mapping[int, float], offsets: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """GPU index -> wall time of a change, as GPU UUID -> monotonic time (``offsets``: GPU index -> (UUID,
    wall minus monotonic of its last reading)); GPUs without a reading are left out."""
    out: dict[str, float] = {}
    for index, wall in changes.items():
        known = offsets.get(index)
        if known is not None:
            out[known[0]] = on_monotonic(wall, known[1])
    return out
