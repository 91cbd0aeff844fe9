"""The training helper's added time per ``run.step()``, measured in the training process itself, with
the exporter unreachable and reachable (the background export then runs during the measurement).

Two ways of timing: batches (total time of N calls / N: the cost a training loop pays on average) and
single calls (``perf_counter_ns`` around each call: shows the rare long calls, which are the background
export thread holding the GIL, not ``step()`` itself). The timer pair alone costs about 0.1 µs; it is
measured and shown, not subtracted.

Never asserts a figure; the "reachable" exporter is a child process on 127.0.0.1.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from typing import Any

from helpers import free_port

from bench import harness
from bench.harness import Context, Table, exporter, fmt, median, percentile

TITLE = "Training helper: added time per step() (design target: < 5 µs)"


class _Empty:
    """A method with step()'s signature that does nothing: the price of the call itself."""

    def step(self, tokens: int = 0, samples: int = 0, loss: Any = None, lr: Any = None, flops: float = 0,
             duration_s: float | None = None) -> None:
        return None


def batch_ns(target: Any, n: int, batches: int, loss: Any = 2.5) -> list[float]:
    """Mean ns per ``target.step(...)`` call in each of ``batches`` batches of ``n`` calls."""
    step = target.step
    out = []
    gc_was = gc.isenabled()
    gc.disable()  # a collection landing in one batch would be noise, not the helper's cost
    try:
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                step(tokens=4096, samples=8, loss=loss, lr=3e-4)
            out.append((time.perf_counter_ns() - t0) / n)
    finally:
        if gc_was:
            gc.enable()
    return out


def single_ns(target: Any, n: int, loss: Any = 2.5) -> list[int]:
    step = target.step
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        step(tokens=4096, samples=8, loss=loss, lr=3e-4)
        out.append(clock() - t0)
    return out


def timer_ns(n: int) -> float:
    clock = time.perf_counter_ns
    vals = []
    for _ in range(n):
        t0 = clock()
        vals.append(clock() - t0)
    return median(vals)


def start_bench_run(endpoint: str, export_interval: float, export_timeout: float = 10.0) -> Any:
    from gpu_energy_exporter.training import start_run

    return start_run(run_id="bench-helper", endpoint=endpoint, export_interval=export_interval,
                     export_timeout=export_timeout, gpu_uuids=["GPU-bench"], rank=0, world_size=1,
                     finish_timeout=2.0)


def run(ctx: Context) -> list[Table]:
    n = ctx.pick(20_000, 200_000)
    batches = ctx.pick(5, 10)
    singles = ctx.pick(20_000, 300_000)
    logging.getLogger("gpu_energy_exporter.training").setLevel(logging.ERROR)
    table = Table(
        "ns per step(tokens=4096, samples=8, loss=2.5, lr=3e-4), in the training process",
        ["case", "batch mean (median of batches)", "worst batch", "single call p50", "single call p99",
         "single call max", "exports delivered / dropped"],
        [f"{batches} batches of {n:,} calls with the garbage collector paused; {singles:,} individually timed "
         f"calls (timer pair alone: {timer_ns(10_000):.0f} ns, included). export_interval=0.5 s so the "
         "background export runs many times during the measurement (the default is 10 s)."],
    )

    def row(label: str, target: Any, loss: Any = 2.5, exports: str = "") -> float:
        b = batch_ns(target, n, batches, loss)
        s = single_ns(target, singles, loss)
        table.add(label, fmt(median(b)), fmt(max(b)), fmt(percentile(s, 50)), fmt(percentile(s, 99)),
                  fmt(max(s) / 1000.0) + " µs", exports)
        return median(b)

    row("empty method, same signature (the call alone)", _Empty())

    # export_timeout 0.3 s: the SDK retries a refused connection with back-off until the timeout, so a
    # short one makes the failed exports complete (and be counted) within the measurement.
    run_ = start_bench_run(f"http://127.0.0.1:{free_port()}", 0.5, export_timeout=0.3)
    try:
        time.sleep(0.6)
        unreachable = row("step(), exporter unreachable (connection refused)", run_)
        run_.finish(timeout=1.0)
        table.rows[-1][-1] = f"{run_.delivered_exports} / {run_.dropped_exports}"
    finally:
        run_.finish(timeout=1.0)

    with exporter(ctx) as exp:
        base = exp.otlp_url
        run_ = start_bench_run(base, 0.5)
        try:
            time.sleep(0.6)
            reachable = row("step(), exporter reachable", run_)
            if not ctx.quick:
                import torch

                row("step(), reachable, loss is a 0-d torch tensor", run_, loss=torch.tensor(2.5))
            run_.finish(timeout=2.0)
            table.rows[-1][-1] = f"{run_.delivered_exports} / {run_.dropped_exports}"
            if not ctx.quick:
                table.rows[-2][-1] = "(same run as below)"
        finally:
            run_.finish(timeout=1.0)
    worst = max(unreachable, reachable) / 1000.0
    table.note(f"Target < 5 µs added per step: {'met' if worst < 5 else 'missed'} ({worst:.2f} µs, the worse of "
               "unreachable/reachable batch means).")
    return [table]


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.helper_overhead"))
