"""The per-scrape sources of /metrics written directly (issue 15) give exactly the bytes of the generic path:
the sample ages (``SnapshotCollector.age_render``) and the exporter's own process series
(``engine.process.ProcessExposition`` against prometheus_client's ``ProcessCollector`` on the same /proc
files), in both formats; and the process series are read again once ``max_age`` has passed, never served
older than that.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import ProcessCollector

from gpu_energy_exporter.core.state import GPUIdentity, GPUState, Snapshot
from gpu_energy_exporter.engine.exposition import SnapshotCollector, encode
from gpu_energy_exporter.engine.process import ProcessExposition


def _identity(i: int) -> GPUIdentity:
    return GPUIdentity(i, f"GPU-{i:04d}-\"odd\\uuid", "NVIDIA H100 80GB HBM3", f"0000:{i:02x}:00.0", "hopper",
                       "9.0", "counter", True)


def test_age_render_is_the_generic_encoding() -> None:
    now = [1_700_000_100.25]
    gpus = tuple(GPUState(_identity(i), True, None, None, 0, None if i == 2 else 1_700_000_000.0 + i * 0.37)
                 for i in range(5))
    sampler = SimpleNamespace(snapshot=Snapshot(1, 0.0, (), (), gpus))
    sc = SnapshotCollector(sampler, clock=lambda: now[0])  # type: ignore[arg-type]
    for step in range(3):
        now[0] += 1.5 * step
        for om in (False, True):
            body = sc.age_render(om)
            assert body == encode(sc.age_families(), om)
            assert body.count(b"\n") == 2 + 4  # HELP, TYPE, one line per GPU with a good sample
    sampler.snapshot = Snapshot(2, 0.0, (), (), ())
    assert sc.age_render(False) == encode(sc.age_families(), False) == b""


def _proc(root: Path, utime: int, fds: int) -> None:
    (root / "stat").write_text("cpu  1 2 3\nbtime 1700000000\n")
    pid = root / "4242"
    (pid / "fd").mkdir(parents=True, exist_ok=True)
    for f in (pid / "fd").iterdir():
        f.unlink()
    for i in range(fds):
        (pid / "fd" / str(i)).write_text("")
    fields = ["S"] + [str(n) for n in range(1, 50)]
    fields[11], fields[12], fields[19], fields[20], fields[21] = str(utime), "37", "12345", "987654321", "4321"
    (pid / "stat").write_text("4242 (odd) name) " + " ".join(fields) + "\n")
    (pid / "limits").write_text("Limit                     Soft Limit           Hard Limit           Units\n"
                                "Max open files            1048576              1048576              files\n")


def test_process_render_is_prometheus_clients_encoding_and_reads_again_after_max_age(tmp_path: Path) -> None:
    _proc(tmp_path, 1234, 3)
    now = [100.0]
    reference = ProcessCollector(namespace="gpuenergy", pid=lambda: 4242, proc=str(tmp_path), registry=None)
    ours = ProcessExposition("gpuenergy", pid=lambda: 4242, proc=str(tmp_path), max_age=1.0, clock=lambda: now[0])
    for om in (False, True):
        assert ours.render(om) == encode(reference.collect(), om)
        assert b"gpuenergy_process_open_fds 3.0\n" in ours.render(om)
    _proc(tmp_path, 99999, 5)
    now[0] += 0.5  # within max_age: the same reading
    assert ours.render(False) != encode(reference.collect(), False)
    assert b"gpuenergy_process_open_fds 3.0\n" in ours.render(False)
    now[0] += 0.6  # past max_age: read again
    for om in (False, True):
        assert ours.render(om) == encode(reference.collect(), om)
    assert b"gpuenergy_process_open_fds 5.0\n" in ours.render(False)


def test_process_render_of_this_process_has_prometheus_clients_families() -> None:
    reference = ProcessCollector(namespace="gpuenergy", registry=None)
    ours = ProcessExposition("gpuenergy", max_age=0.0)
    for om in (False, True):
        names = [line.split(b" ")[0] for line in ours.render(om).splitlines() if not line.startswith(b"#")]
        expected = [line.split(b" ")[0] for line in encode(reference.collect(), om).splitlines()
                    if not line.startswith(b"#")]
        assert names == expected and len(names) == (6 if os.path.exists("/proc/self/limits") else 4)


def test_receiver_self_metrics_encode_is_the_generic_encoding() -> None:
    from gpu_energy_exporter.otlp.selfmetrics import Tally

    tally = Tally()
    for step in range(3):
        tally.requests["200"] += 7 * step
        tally.requests["429"] = float(step)  # a status first seen now
        tally.rejected["bytes_limit"] += 1e21 * step
        tally.received, tally.request_seconds, tally.resets = 123.0 * step, 0.1 * step, float(step)
        copy = tally.copy()
        for om in (False, True):
            assert copy.encode(1000 + step, 5 << 20, om) == encode(tally.families(1000 + step, 5 << 20), om)
    copy = tally.copy()
    tally.requests["200"] += 1  # the copy does not move with the store's counters
    assert copy.encode(1, 2, False) != encode(tally.families(1, 2), False)
    assert copy.encode(1, 2, False) == encode(copy.families(1, 2), False)
