"""Memory soak at realistic run churn: does the exporter's RSS stay flat once it has warmed up?

``python -m bench.soak --duration 30m [--warmup 5m] [--churn 5m] [--series 1000]``

The exporter runs with its default flags on 8 fake H100s (the fake NVML library), scraped every 15 s.
``bench.pusher`` plays 77 training ranks (1,000 series, the training helper's instruments) pushing every
U(5, 15) s; every ``--churn`` all runs are replaced by runs with new ids, so the old series age out through
``--otlp.series-ttl`` and the old runs are closed by the ledger after ``--runs.stale-after`` (both at their
defaults). RSS (VmRSS) is sampled every ``--sample-interval``. After ``--warmup`` the soak reports the
least-squares RSS slope in MB per hour and the spread (max - min) of RSS: a leak shows as a slope that
does not shrink with a longer soak; a bounded cache shows as a spread that stays put.

Never asserts a figure; talks only to the exporter it started on 127.0.0.1; stops by itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench import harness
from bench.exporter_cost import _pusher, _scraper, _slope, _summary
from bench.harness import Context, HTTPClient, Table, exporter, fmt
from gpu_energy_exporter.daemon.config import parse_duration

TITLE = "Memory soak at realistic run churn (RSS slope after warm-up)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", default="30m", help="length of the soak (default 30m; e.g. 300s, 5m)")
    p.add_argument("--warmup", default=None, help="start excluded from the slope (default: a third of "
                   "--duration, at most 10m)")
    p.add_argument("--churn", default="5m", help="every run is replaced by a new run id this often (default 5m)")
    p.add_argument("--series", type=int, default=1000, help="training series pushed at a time (default 1000)")
    p.add_argument("--min-interval", type=float, default=5.0, help="shortest push interval per rank, s")
    p.add_argument("--max-interval", type=float, default=15.0, help="longest push interval per rank, s")
    p.add_argument("--sample-interval", default="10s", help="RSS sampling period (default 10s)")
    p.add_argument("--exporter-arg", action="append", default=[], help="extra exporter flag (repeatable)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    try:
        duration = parse_duration(args.duration)
        churn = parse_duration(args.churn)
        sample = parse_duration(args.sample_interval)
        warmup = parse_duration(args.warmup) if args.warmup else min(duration / 3, 600.0)
    except ValueError as exc:
        p.error(str(exc))
    if not 0 <= warmup < duration or sample <= 0:
        p.error("--warmup must be shorter than --duration and --sample-interval positive")
    command = harness.command_string("bench.soak", argv)
    print(f"## {TITLE}\n\ncommand: `{command}`  \n{harness.machine_line()}\n")
    with tempfile.TemporaryDirectory(prefix="gee-soak-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = Context(quick=False, workdir=workdir, soak_s=duration, peers=False, command=command)
        tables, result = soak(ctx, duration=duration, warmup=warmup, churn=churn, sample=sample,
                              series=args.series, intervals=(args.min_interval, args.max_interval),
                              extra=args.exporter_arg)
    for table in tables:
        print(table.render())
    print(json.dumps(result))
    return 0


def soak(ctx: Context, *, duration: float, warmup: float, churn: float, sample: float, series: int,
         intervals: tuple[float, float], extra: Sequence[str] = ()) -> tuple[list[Table], dict[str, object]]:
    path = ctx.path("soak-8gpu.ini")
    harness.write_scenario(path, harness.h100s(8))
    table = Table(
        f"RSS over a {duration / 60:g} min soak (8 fake GPUs, default flags, scrape every 15 s)",
        ["t (s)", "RSS MB", "training series", "store bytes (estimate) MB", "series expired (total)",
         "ledger runs finished (total)"],
        [f"{series} series from {-(-series // 13)} ranks pushing every U({intervals[0]:g}, {intervals[1]:g}) s; "
         f"every {churn:g} s all runs get new ids ({duration / churn:.1f} generations). Warm-up "
         f"{warmup:g} s excluded from the summary."],
    )
    rss: list[tuple[float, float]] = []
    with exporter(ctx, scenario=path, args=list(extra)) as exp:
        stop = threading.Event()
        scraper = _scraper(exp.scrape_url, 15.0, stop)
        reader = HTTPClient(exp.scrape_url)
        pusher = _pusher(exp.push_url, series, duration, min_i=intervals[0], max_i=intervals[1], churn=churn,
                         prefix="soak")
        with pusher:
            t0 = time.monotonic()
            i = 0
            while True:
                target = t0 + i * sample
                if target > t0 + duration:
                    break
                time.sleep(max(0.0, target - time.monotonic()))
                elapsed = time.monotonic() - t0
                r = harness.rss_bytes(exp.pid) / 1e6
                rss.append((elapsed, r))
                if i % max(1, round(60 / sample)) == 0 or target + sample > t0 + duration:
                    _, body, _ = reader.get()
                    text = body.decode()
                    table.add(f"{elapsed:.0f}", fmt(r), int(harness.sample_total(text, "gpuenergy_otlp_series")),
                              fmt(harness.sample_total(text, "gpuenergy_otlp_store_bytes") / 1e6),
                              int(harness.sample_total(text, "gpuenergy_otlp_series_expired_total")),
                              int(harness.sample_total(text, "gpuenergy_ledger_runs_finished_total")))
                i += 1
            pusher.proc.wait(30)
        stop.set()
        scraper.join()
        reader.close()
    after = [p for p in rss if p[0] >= warmup]
    slope_mb_h = _slope(after) * 3600.0
    spread = max(r for _, r in after) - min(r for _, r in after)
    done = _summary(pusher)
    summary = Table("Soak summary", ["figure", "value"])
    summary.add("RSS at the end of the warm-up (MB)", fmt(after[0][1]))
    summary.add("RSS at the end (MB)", fmt(after[-1][1]))
    summary.add("RSS max - min after the warm-up (MB)", fmt(spread))
    summary.add("RSS slope after the warm-up (MB per hour, least squares)", f"{slope_mb_h:+.2f}")
    summary.add("pusher", f"{done.get('pushes')} pushes, {done.get('points')} points, {done.get('failures')} "
                f"failed, {done.get('generations')} generations of run ids")
    result: dict[str, object] = {
        "event": "soak", "duration_s": duration, "warmup_s": warmup, "churn_s": churn, "series": series,
        "rss_after_warmup_mb": round(after[0][1], 2), "rss_end_mb": round(after[-1][1], 2),
        "rss_spread_after_warmup_mb": round(spread, 2), "rss_slope_mb_per_hour": round(slope_mb_h, 2),
        "pushes": done.get("pushes"), "push_failures": done.get("failures"),
    }
    return [table, summary], result


if __name__ == "__main__":
    sys.exit(main())
