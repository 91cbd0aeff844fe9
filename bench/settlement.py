"""Settlement (issue 28): runs charged what the GPU's counter says of their own interval, whatever the power's
shape. A whole node in one process on a frozen clock (``tests/settle_rig.py``): the fake NVML library with a
scripted power trace whose counter is its exact integral, the real GPU collector and sampler at the daemon's
defaults (a sample a second, the counter every 30 s), the real run ledger, and a trainer pushing as the
training helper does. Each run's energy is compared with the trace's exact integral over [start, end].

Two ways of charging, side by side on the same traces:

- before: the ledger charged each sample interval the apportioned energy (the counter's last total plus the
  scaled power readings, held when it ran ahead), and a run's edge read the counter at the next 1 s tick;
- settled: each span between two counter reads is settled at the read (the counter's delta spread by the
  power readings' shape), and a run's edge reads the counter in a sample taken at once (20 ms later here).

Runs start at 21 phases spread over a 10 s period (and 3.3 s past it, so no start falls on the sample grid),
after 35 s of the trace. Never asserts a figure.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from settle_rig import EPOCH, Node, Pusher, h100_with

from bench import harness
from bench.accuracy import BURSTY
from bench.harness import Context, Table, fakenvml, pct

TITLE = ("Settlement: runs against the exact integral of their own interval (target: every run of 8 s or more "
         "within 1%)")

TRACES: tuple[tuple[str, fakenvml.PowerTrace], ...] = (
    ("10 s square wave 150/650 W", fakenvml.Square(150.0, 650.0, 10.0, 0.5)),
    ("0.7 s square wave 150/650 W", fakenvml.Square(150.0, 650.0, 0.7, 0.5)),
    ("a step 120 -> 690 W at 47 s", fakenvml.Steps(((47.0, 120.0), (400.0, 690.0)), repeat=False)),
    ("bursty steps (311 ms cycle)", BURSTY),
    ("steady 300 W", fakenvml.Constant(300.0)),
)
LENGTHS = (8.0, 12.5, 45.0)
LOADED_JITTER = 0.6  # s: how late a sample may be taken on a loaded machine


def _errors(lib: Path, trace: fakenvml.PowerTrace, length: float, phases: list[float], *, settle: bool,
            jitter: float) -> list[float]:
    out = []
    for k, phase in enumerate(phases):
        with tempfile.TemporaryDirectory(prefix="gee-settle-") as tmp:
            node = Node(lib, Path(tmp), [h100_with(0, trace)], settle=settle, early=settle, jitter=jitter, seed=k)
            try:
                start = EPOCH + 35.0 + phase
                node.add(Pusher("r", start, start + length, node.gpus[0].uuid))
                node.run_until(start + length + 3.0)
                s = node.ledger.run("r")
                truth = node.true_energy_j(0, start, start + length)
                out.append(s["energy_j"] / truth - 1.0 if s and s.get("energy_j") is not None else float("nan"))
            finally:
                node.close()
    return out


def run(ctx: Context) -> list[Table]:
    phases = [round(3.3 + 0.5 * k, 2) for k in range(ctx.pick(5, 21))]
    table = Table(
        "Run energy against the exact integral over [start, end]: mean |error| (worst, signed), "
        f"{len(phases)} start phases per cell",
        ["trace", "machine", *(f"{length:g} s runs, before" for length in LENGTHS),
         *(f"{length:g} s runs, settled" for length in LENGTHS)],
        ["before: the apportioned energy of each sample interval, the edge's counter read at the next 1 s tick "
         "(main at 450c1b4 in the daemon); settled: issue 28 (spans settled at each read, edges read at once).",
         f"machine: idle, every sample on the second; loaded, each sample taken up to {LOADED_JITTER:g} s late "
         "(a seeded sequence, the same for before and settled). Frozen clock: every figure is exact arithmetic "
         "on the scenario, whatever this machine's own load."],
    )
    worst = 0.0
    for name, trace in TRACES:
        for machine, jitter in (("idle", 0.0), ("loaded", LOADED_JITTER)):
            cells_before, cells_after = [], []
            for length in LENGTHS:
                cells_before.append(_cell(_errors(ctx.lib, trace, length, phases, settle=False, jitter=jitter)))
                errors = _errors(ctx.lib, trace, length, phases, settle=True, jitter=jitter)
                worst = max(worst, *(abs(e) for e in errors))
                cells_after.append(_cell(errors))
            table.add(name, machine, *cells_before, *cells_after)
    verdict = Table("Against the target", ["target", "worst run", "met"])
    verdict.add("every run of 8 s or more within 1% of the exact integral", pct(worst, 3),
                "yes" if worst <= 0.01 else "no")
    return [table, verdict]


def _cell(errors: list[float]) -> str:
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    worst = max(errors, key=abs)
    return f"{pct(mean_abs, 2)} ({pct(worst, 2, signed=True)})"


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.settlement"))
