"""A job's edges (issue 28): the job-mapping files' own modification times (``slurm.edges``, pure), and the
directory watch that reads the energy counters as soon as the prolog or epilog writes (``slurm.watch``: real
inotify through ctypes on a real directory, and its polling fallback).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_energy_exporter.collectors.slurm.edges import MappingEdges, monotonic_cuts
from gpu_energy_exporter.collectors.slurm.mapping import mapping_signature, read_mapping
from gpu_energy_exporter.collectors.slurm.watch import DirectoryWatch

T0 = 1_750_000_000.0


def write(d: Path, name: str, jobs: list[str], t: float) -> None:
    """``name`` lists ``jobs`` (removed when none), written at ``t`` as the prolog writes (temp file, rename)."""
    path = d / name
    if jobs:
        tmp = d / f".tmp.{name}"
        tmp.write_text("".join(f"{j}\n" for j in jobs))
        os.utime(tmp, ns=(int(t * 1e9), int(t * 1e9)))
        tmp.rename(path)
    else:
        path.unlink()
    os.utime(d, ns=(int(t * 1e9), int(t * 1e9)))


def read(edges: MappingEdges, d: Path, now: float = 0.0) -> dict[int, float]:
    return edges.update(mapping_signature(d), read_mapping(d), lambda: os.stat(d).st_mtime_ns / 1e9, now)


def test_edges_are_the_files_mtimes_and_a_removal_is_the_directorys(tmp_path: Path) -> None:
    d = tmp_path / "map"
    d.mkdir()
    write(d, "0", ["7"], T0)
    edges = MappingEdges()
    assert read(edges, d) == {}  # jobs found at the first read were there before: no edge
    assert edges.since == {"7": None}
    write(d, "1", ["8"], T0 + 10.25)
    write(d, "2.1", ["8"], T0 + 10.5)  # a MIG instance of GPU 2
    assert read(edges, d) == pytest.approx({1: T0 + 10.25, 2: T0 + 10.5})
    assert edges.since == pytest.approx({"7": None, "8": T0 + 10.25})  # its first file
    assert read(edges, d) == {}  # nothing changed since
    write(d, "0", ["7", "9"], T0 + 20.0)  # a second job on GPU 0: its file's time is 9's start, 7 goes on
    assert read(edges, d) == pytest.approx({0: T0 + 20.0})
    assert edges.since["9"] == pytest.approx(T0 + 20.0) and edges.since["7"] is None
    write(d, "1", [], T0 + 30.0)  # the epilog: 8 leaves GPU 1 (file removed) then the instance of GPU 2
    write(d, "2.1", [], T0 + 30.5)
    # a removed file's time is the directory's mtime: the last removal of the read (one epilog: milliseconds)
    assert read(edges, d, now=100.0) == pytest.approx({1: T0 + 30.5, 2: T0 + 30.5})
    assert "8" not in edges.since and list(edges.ended) == ["8"]
    assert edges.ended["8"] == pytest.approx((T0 + 30.5, 100.0))
    read(edges, d, now=100.0 + 61.0)
    assert edges.ended == {}  # kept a minute for the snapshots after it


def test_edges_go_onto_the_monotonic_clock_of_each_gpus_reading() -> None:
    offsets = {0: ("GPU-a", 1000.0), 1: ("GPU-b", 2000.0)}
    assert monotonic_cuts({0: 1010.5, 1: 2003.0, 5: 7.0}, offsets) == {"GPU-a": 10.5, "GPU-b": 3.0}


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "the watch did not see the change"
        time.sleep(0.005)


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])
def test_the_watch_calls_on_every_write_of_the_prolog_and_epilog(tmp_path: Path, inotify: bool) -> None:
    """The directory appears (the first prolog creates it), a GPU file is written by rename, removed, the
    directory removed and made again: each is a call; with inotify the temp file alone is not."""
    d = tmp_path / "map"
    calls: list[float] = []
    watch = DirectoryWatch(str(d), lambda: calls.append(time.monotonic()), poll_s=0.02, inotify=inotify)
    watch.start()
    try:
        assert watch.mode == ("inotify" if inotify else "poll")
        time.sleep(0.1)
        assert calls == []
        d.mkdir()
        wait_for(lambda: len(calls) >= 1)
        time.sleep(0.1)  # (the watch is set up on the new directory)
        n = len(calls)
        if inotify:
            (d / ".tmp.0.42").write_text("7\n")  # the prolog's temp file: not an edge yet
            time.sleep(0.2)
            assert len(calls) == n
            (d / ".tmp.0.42").unlink()
        write(d, "0", ["7"], T0)
        wait_for(lambda: len(calls) > n)
        n = len(calls)
        write(d, "0", [], T0 + 5)
        wait_for(lambda: len(calls) > n)
        n = len(calls)
        d.rmdir()
        wait_for(lambda: len(calls) > n)
        time.sleep(0.1)
        n = len(calls)
        d.mkdir()
        write(d, "1", ["8"], T0 + 9)
        wait_for(lambda: len(calls) > n)
    finally:
        started = time.monotonic()
        watch.stop()
        assert time.monotonic() - started < 1.0  # stops at once, not at a timeout


def test_a_failing_listener_does_not_stop_the_watch(tmp_path: Path) -> None:
    calls: list[int] = []

    def listener() -> None:
        calls.append(1)
        raise RuntimeError("boom")

    watch = DirectoryWatch(str(tmp_path), listener)
    watch.start()
    try:
        time.sleep(0.1)
        write(tmp_path, "0", ["7"], T0)
        wait_for(lambda: len(calls) >= 1)
        write(tmp_path, "1", ["8"], T0)
        wait_for(lambda: len(calls) >= 2)
    finally:
        watch.stop()


def test_a_jobs_info_written_after_its_gpu_file_changes_the_signature_so_it_is_read(tmp_path: Path) -> None:
    # The prolog used to write .info/<job> after the GPU files; a read in between (the watch reads at the first
    # write) found no user, and the signature, GPU files only, never changed again: the job's row had no user
    # (tests/test_slurm_real.py under load). The .info files are part of the signature now.
    d = tmp_path / "map"
    (d / ".info").mkdir(parents=True)
    write(d, "0", ["7"], T0)
    before = mapping_signature(d)
    assert not getattr(read_mapping(d).info.get("7"), "user", "")  # read before the info: no user
    (d / ".info" / ".tmp.7").write_text("user=alice\npartition=gpu\n")  # the prolog's temp file: not yet
    assert mapping_signature(d) == before
    (d / ".info" / ".tmp.7").rename(d / ".info" / "7")
    after = mapping_signature(d)
    assert after != before
    assert read_mapping(d).info["7"].user == "alice"
    edges = MappingEdges()
    read(edges, d)
    assert read(edges, d) == {}  # an info file is no GPU's edge
