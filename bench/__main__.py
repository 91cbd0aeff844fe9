"""``python -m bench [--quick] [--only NAME,...]``: run the benchmarks in order and print their tables."""

from __future__ import annotations

import importlib
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench import harness

#: Run order: cheap and self-contained first; peers last (they may install packages on first use).
MODULES: tuple[str, ...] = (
    "scrape_latency", "exporter_cost", "otlp_throughput", "helper_overhead", "accuracy", "energy_schedule",
    "settlement", "peers",
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = harness.new_parser("python -m bench")
    parser.add_argument("--only", default="", help="comma-separated benchmarks to run: " + ", ".join(MODULES))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(MODULES)
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    started = time.monotonic()
    print(f"# gpu-energy-exporter benchmarks{' (--quick: smoke run, figures not meaningful)' if args.quick else ''}\n")
    print(f"command: `{harness.command_string('bench', argv)}`  ")
    print(harness.machine_line() + "\n")
    ok = True
    with tempfile.TemporaryDirectory(prefix="gee-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = harness.make_context(args, harness.command_string("bench", argv), workdir)
        for name in names:
            ok = harness.run_benchmark(importlib.import_module(f"bench.{name}"), ctx) and ok
            sys.stdout.flush()
    print(f"total: {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
