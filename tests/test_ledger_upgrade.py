"""Upgrades and planted state, with the exporter as a real process (issue 30).

- A run started under the previous release (commit 450c1b4, its pickle journal: the state that release itself
  left in ``tests/fixtures/ledger-450c1b4/`` when it was killed mid-run, README there) continues under this
  one: the journal is migrated once into the database and the run finishes as one row with every token and
  the energy of its whole duration, the downtime's from the GPU's counter. Before: a journal of another
  release did not load and the ledger started empty.
- A state directory another user made world-writable, with a journal record planted in it: the record is
  never executed (it never is anywhere: a restricted unpickler), the directory is refused with a log line
  saying how to fix it, and runs are kept in memory. Before: the record was unpickled and ran its command.

Fake NVML draws a constant 300 W, from the same epoch as when the fixture was made: the GPU's energy
counter continues across the fixture's downtime as it would on a real node. The exporter runs under
libfaketime only to keep its wall clock after the fixture's times on a machine whose clock is behind them.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import pickle
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from fakenvml import Constant, Scenario, h100
from helpers import ExporterProcess, sample_value, wait_until
from test_otlp_limits import _wrap, counter, gauge, post

from gpu_energy_exporter.ledger.journal import FORMAT, record

FIXTURE = Path(__file__).parent / "fixtures" / "ledger-450c1b4"


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _push(exp: ExporterProcess, run_id: str, gpu: str, tokens: float, t: float, finished: float | None = None) -> None:
    labels = {"run_id": run_id, "rank": "0", "gpu_uuid": gpu}
    metrics = [counter("training.tokens", labels, tokens, t=int(t * 1e9), unit="{token}")]
    if finished is not None:
        metrics.append(gauge("training.run.finished", [({"run_id": run_id, "rank": "0"}, finished)], t=int(t * 1e9)))
    status, response = post(exp.push_url, _wrap(*metrics))
    assert status == 200 and response.partial_success.rejected_data_points == 0, response


def _faketime(tmp_path: Path, offset_s: float) -> dict[str, str]:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")) + sorted(
        glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    if not found:
        pytest.fail("libfaketime is not installed (Debian package faketime; .ci/setup-test-env installs it)")
    offset = tmp_path / "offset.faketime"
    offset.write_text(f"+{offset_s:.0f}\n")
    return {"LD_PRELOAD": found[0], "FAKETIME_TIMESTAMP_FILE": str(offset), "DONT_FAKE_MONOTONIC": "1"}


def test_a_run_begun_under_the_previous_release_finishes_under_this_one_as_one_exact_row(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    facts = json.loads((FIXTURE / "facts.json").read_text())
    ledger = tmp_path / "ledger"
    shutil.copytree(FIXTURE, ledger, ignore=shutil.ignore_patterns("*.py", "*.md", "facts.json"))
    ledger.chmod(0o755)  # as git checks files out: the state dir the old release made 0700, its files 0644
    (ledger / ".runs-state").chmod(0o700)
    before = (ledger / "runs.csv").read_bytes()
    # The machine's clock is normally after the fixture's; a machine whose clock is behind it runs the
    # exporter that much ahead (its GPU counter and its clock alike; the monotonic clock is never faked).
    offset = max(0.0, facts["killed_at"] + 60.0 - time.time())
    gpu = h100(0, power=Constant(facts["watts"]))
    assert gpu.uuid == facts["gpu_uuid"]
    Scenario(epoch=facts["epoch"], gpus=[gpu]).write(tmp_path / "scenario.ini")
    env = {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini"), **_faketime(tmp_path, offset)}
    # The fixture's pushes (raw OTLP, as here) name the GPU but no process.pid: such a claim is charged for
    # --runs.claim-grace from the run's start (docs/ledger.md), here long enough to cover the fixture's age.
    grace_h = int((time.time() + offset - facts["pushes"][0]["t"]) / 3600) + 2
    args = [f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--runs.warmup=0s",
            f"--runs.csv={ledger / 'runs.csv'}", f"--runs.claim-grace={grace_h}h"]
    exp = start_exporter(args, env).wait_ready()
    assert "migrated the previous release's journal" in exp.log(), exp.log()
    assert (ledger / ".runs-state" / "journal-00000001.log.migrated").exists()
    last = facts["pushes"][-1]
    t = time.time() + offset
    _push(exp, facts["run_id"], gpu.uuid, last["tokens"] + 1000.0, t)
    time.sleep(1.0)
    _push(exp, facts["run_id"], gpu.uuid, last["tokens"] + 2500.0, t + 1.0)
    time.sleep(1.0)
    _push(exp, facts["run_id"], gpu.uuid, last["tokens"] + 3000.0, t + 2.0, finished=1.0)
    rows = wait_until(lambda: [r for r in _rows(ledger / "runs.csv") if r["run_id"] == facts["run_id"]] or None,
                      timeout=40, what="the upgraded run's row")
    exp.stop()
    all_rows = _rows(ledger / "runs.csv")
    assert [r["run_id"] for r in all_rows] == [facts["finished_run_id"], facts["run_id"]], "one row, appended"
    assert (ledger / "runs.csv").read_bytes().startswith(before), "the old release's rows untouched"
    [row] = rows
    start = facts["pushes"][0]["t"]
    end = t + 2.0
    print("upgrade figures:", {k: row[k] for k in ("tokens", "energy_j", "duration_s", "start_time", "ledger_notes")},
          f"expected {300.0 * (end - start):.1f} J over {end - start:.1f}s")
    assert row["status"] == "finished"
    assert float(row["tokens"]) == last["tokens"] + 3000.0, "every token, once"
    assert float(row["duration_s"]) == pytest.approx(end - start, abs=0.5)
    # 300 W over the whole run: before the upgrade, across the downtime (the GPU's counter) and after
    assert float(row["energy_j"]) == pytest.approx(facts["watts"] * float(row["duration_s"]), rel=0.001)
    assert row["model"] == facts["model"] and row["backend"] == facts["backend"]
    assert "gap_s=" in row["ledger_notes"]
    with sqlite3.connect(ledger / ".runs-state" / "runs.db") as db:
        assert db.execute("SELECT run_id, tokens, exported FROM runs").fetchall() == [
            (facts["run_id"], last["tokens"] + 3000.0, 1)]
        assert db.execute("SELECT count(*) FROM open_runs").fetchone() == (0,)
    # Migrated once: a second start neither reads the journal again nor writes the row again.
    again = start_exporter(args, env).wait_ready()
    time.sleep(1.0)
    again.stop()
    assert "migrated" not in again.log()
    assert [r["run_id"] for r in _rows(ledger / "runs.csv")] == [facts["finished_run_id"], facts["run_id"]]


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"id > {self.marker}",))


def test_a_planted_record_in_a_foreign_world_writable_state_dir_is_never_executed(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """``--runs.csv`` in a shared directory where a tenant pre-created ``.runs-state`` world-writable and
    planted a record with a valid CRC (the issue's reproduction: ``id`` ran as uid 0)."""
    shared = tmp_path / "x"
    state = shared / ".runs-state"
    state.mkdir(parents=True)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"format": FORMAT, "active": [_Planted(marker)], "pending": []})
    (state / "journal-00000001.log").write_bytes(record(payload))
    state.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(state, 65534, 65534)
        os.chown(state / "journal-00000001.log", 65534, 65534)
    gpu = h100(0, power=Constant(300.0))
    Scenario(epoch=time.time() - 60, gpus=[gpu]).write(tmp_path / "scenario.ini")
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--runs.warmup=0s",
                          f"--runs.csv={shared / 'runs.csv'}"],
                         {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}).wait_ready()
    time.sleep(0.5)
    assert not marker.exists(), "the planted record ran: " + marker.read_text()
    refusal = [line for line in exp.lines if "refusing" in line]
    assert refusal and str(state) in refusal[0] and "chmod 700" in refusal[0], exp.log()
    assert sample_value(exp.metrics(), "gpuenergy_ledger_state_lost_total", reason="refused") == 1.0
    now = time.time()
    _push(exp, "in-memory", gpu.uuid, 0.0, now)
    time.sleep(1.0)
    _push(exp, "in-memory", gpu.uuid, 100.0, now + 1.0, finished=1.0)
    wait_until(lambda: _rows(shared / "runs.csv") or None, timeout=20, what="the row, still written to the CSV")
    exp.stop()
    assert not marker.exists()
    assert sorted(p.name for p in state.iterdir()) == ["journal-00000001.log"], "nothing read or written there"


def test_owners_of_the_release_before_identity_become_this_releases_clients() -> None:
    """450c1b4's clients were (peer address, host, pid, instance); this release's are (principal, identity, host,
    pid, instance), a loopback pusher's identity the kernel's view of its process. A migrated run's remote
    owner becomes the ``ip=`` identity that address still gets; a loopback owner, which the journal cannot
    name now, is dropped so that the owning process's next push owns the rank again: before, its identity
    never matched the old string and every push after the upgrade went to a scoped run id (the run in two)."""
    from gpu_energy_exporter.core.clientid import client_id, identity_of
    from gpu_energy_exporter.ledger.migrate import legacy_owners
    from gpu_energy_exporter.ledger.runs import Run

    sep = "\x1f"
    run = Run("r", 0.0, 0.0, False, 4, 0.0)
    run.client = sep.join(("127.0.0.1", "node-a", "41", "uuid-1"))
    run.owners = {"0": run.client, "1": sep.join(("10.0.0.7", "node-b", "42", "uuid-2"))}
    legacy_owners(run)
    remote = client_id("10.0.0.7", (("host_name", "node-b"), ("process_pid", "42"), ("service_instance_id", "uuid-2")))
    assert run.owners == {"1": remote} and identity_of(run.owners["1"]) == "ip=10.0.0.7"
    assert run.client == ""
    # a client of this release is kept as it is
    mine = client_id("10.0.0.9", ())
    run.owners, run.client = {"0": mine}, mine
    legacy_owners(run)
    assert run.owners == {"0": mine} and run.client == mine
