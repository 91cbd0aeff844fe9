"""A settled run across an exporter restart (issues 28, 29 and 30 together): the run's figures, its settled
and provisional parts, the counters /metrics serves as of its settled time (its series' recent points) and
who owns it come back from the ledger's database exactly as they were, and the run goes on as it would have
without the restart.

The whole node on a frozen clock (``settle_rig``): the restart happens between two samples, so the figures
before and after it are compared at one instant, and the finished run against the same run on a node that
never restarted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fakenvml import Square
from settle_rig import EPOCH, Node, Pusher, h100_with, rel_error

from gpu_energy_exporter.core.clientid import client_id, kernel_peer

WAVE_10S = Square(150.0, 650.0, 10.0, 0.5)
#: the trainer as the receiver knows it: the kernel's view of its process (uid, pid and start time)
TRAINER = client_id(kernel_peer(1000, 4242, "77"), (("host_name", "node-1"), ("process_pid", "4242")))
SERVED = ("gpuenergy_run_tokens_total", "gpuenergy_run_energy_joules_total", "gpuenergy_run_co2_grams_total",
          "gpuenergy_run_energy_provisional_joules")
FIGURES = ("tokens", "energy_j", "energy_provisional_j", "window_energy_j", "co2_g", "co2_provisional_g",
           "duration_s", "j_per_token")


def _node(lib: Path, tmp: Path, state_dir: str | None = None) -> Node:
    tmp.mkdir()
    return Node(lib, tmp, [h100_with(0, WAVE_10S)], carbon=lambda: (400.0, 1.25), state_dir=state_dir)


def _run(node: Node, until: float) -> dict[str, float | None]:
    node.run_until(until)
    s = node.ledger.run("r1")
    assert s is not None
    return {**{k: s.get(k) for k in FIGURES}, **{n: node.served(n, "r1") for n in SERVED}}


def test_a_settled_run_comes_back_from_the_database_as_it_was_and_goes_on(fake_nvml_lib: Path,
                                                                          tmp_path: Path) -> None:
    """Restarted 20 s after a counter read (a settled part and a provisional part): the run's accumulator, its
    series with their recent points and its owners come back equal, and its live figures as the snapshot saved
    last had them; it finishes as one run with every token, settled. What a restart does not carry (the
    snapshot history and the counters' last reads): the part since the last read before the restart is not
    settled again at the next read, it stays the power readings' estimate (-1.25% of this run's energy here;
    main's pickle journal gave the same figures to the last digit)."""
    start, end = EPOCH + 40.3, EPOCH + 160.3
    mid = start + 50.0  # 20 s after the counter read of start + 30 s
    ref = _node(fake_nvml_lib, tmp_path / "ref")
    try:
        ref.add(Pusher("r1", start, end, h100_with(0, WAVE_10S).uuid, every=1.0, client=TRAINER))
        ref_mid = _run(ref, mid)
        ref_end = _run(ref, end + 3.0)
    finally:
        ref.close()
    node = _node(fake_nvml_lib, tmp_path / "node", str(tmp_path / "node" / "state"))
    try:
        node.add(Pusher("r1", start, end, h100_with(0, WAVE_10S).uuid, every=1.0, client=TRAINER))
        before = _run(node, mid)
        assert before == ref_mid, "the database changes nothing while the exporter runs"
        provisional = before["energy_provisional_j"]
        assert provisional is not None and provisional > 1000.0, "a provisional part to carry across"
        assert before["gpuenergy_run_tokens_total"] < before["tokens"], "tokens served as of the settled time"
        old = node.ledger._active["r1"]
        saved = (old.acc.copy(), dict(old.series), dict(old.owners), old.client, old.s, old.last_point_t)
        node.restart()
        run = node.ledger._active["r1"]
        assert run is not old
        assert (run.acc, run.series, run.owners, run.client, run.s, run.last_point_t) == saved
        assert run.owners == {"0": TRAINER}, "the run is still its trainer's"
        assert all(len(s.hist) > 30 for s in run.series.values()), "each series' recent points"
        live = node.ledger.run("r1")
        assert live is not None and live["tokens"] == before["tokens"]
        assert live["energy_j"] == pytest.approx(run.acc.energy_j), "the energy of the last saved snapshot"
        done = _run(node, end + 3.0)
        assert [r["run_id"] for r in node.ledger.runs()] == ["r1"], "one run, its trainer's"
    finally:
        node.close()
    print("restart figures:", {k: (done[k], ref_end[k]) for k in FIGURES})
    truth = node.true_energy_j(0, start, end)
    assert done["tokens"] == ref_end["tokens"] == 1000.0 * (end - start), "every token once"
    assert done["energy_provisional_j"] == 0.0 and done["co2_provisional_g"] == 0.0, "settled at the end"
    assert done["duration_s"] == ref_end["duration_s"]
    assert abs(rel_error(ref_end["energy_j"], truth)) <= 0.01
    assert abs(rel_error(done["energy_j"], truth)) <= 0.02, "the provisional part at the restart stays estimated"
