"""Load generator (not a benchmark): simulated training ranks pushing OTLP exports on their own schedules.

``python -m bench.pusher URL --series N --min-interval S --max-interval S --duration S [--churn S]``

Each rank (13 series, like the training helper's) pushes every U(min, max) seconds, as many trainers with
the SDK's periodic reader would; with ``--churn S`` every run is replaced by a run with a new id after S
seconds (old series then age out through the exporter's TTL). It runs in its own process so that its work
does not compete with the measuring client for the GIL. At the end it prints one JSON line with what it
did. It only ever connects to the URL it is given (127.0.0.1 in the benchmarks) and stops by itself.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import signal
import sys
import time
from collections.abc import Sequence

from bench.harness import HTTPClient
from bench.trainers import Trainer, push, trainers_for


class _Stopped(Exception):
    pass


def _prefix(args: argparse.Namespace, generation: int) -> str:
    return f"{args.prefix}{generation}" if args.churn > 0 else args.prefix


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pusher")
    p.add_argument("url")
    p.add_argument("--series", type=int, required=True)
    p.add_argument("--min-interval", type=float, default=1.0)
    p.add_argument("--max-interval", type=float, default=10.0)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--churn", type=float, default=0.0, help="seconds after which a run gets a new run id")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix", default="gen", help="run id prefix (the generation number is appended "
                   "with --churn)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    def on_term(*_: object) -> None:
        raise _Stopped  # interrupts the sleep between pushes; the summary is still printed

    signal.signal(signal.SIGTERM, on_term)
    client = HTTPClient(args.url)
    generation = 0
    trainers: list[Trainer] = trainers_for(args.series, prefix=_prefix(args, generation))
    now = time.monotonic()
    end = now + args.duration
    queue = [(now + rng.uniform(0, args.max_interval), i) for i in range(len(trainers))]
    heapq.heapify(queue)
    next_churn = now + args.churn if args.churn > 0 else float("inf")
    pushes = points = failures = 0
    push_s: list[float] = []
    print(json.dumps({"event": "started", "ranks": len(trainers)}), flush=True)
    try:
        while queue:
            t, i = heapq.heappop(queue)
            if t >= end:
                break
            if t >= next_churn:
                generation += 1
                trainers = trainers_for(args.series, prefix=_prefix(args, generation))
                next_churn += args.churn
            delay = t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                status, n, elapsed = push(client, trainers[i])
            except OSError:
                failures += 1
            else:
                pushes += 1
                points += n
                push_s.append(elapsed)
                failures += status != 200
            heapq.heappush(queue, (t + rng.uniform(args.min_interval, args.max_interval), i))
    except _Stopped:
        pass
    client.close()
    push_s.sort()
    print(json.dumps({"event": "done", "pushes": pushes, "points": points, "failures": failures,
                      "generations": generation + 1,
                      "push_median_ms": push_s[len(push_s) // 2] * 1000 if push_s else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
