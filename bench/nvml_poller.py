"""The hand-written NVML polling threads users put in training scripts (not a benchmark: accuracy.py
starts this as a child process with the fake library on LD_LIBRARY_PATH, so pynvml loads it as it loads
the driver's).

``python -m bench.nvml_poller --gpus N --start T0 --end T1 --out FILE`` polls, each in its own thread:

- ``instant_50ms`` / ``instant_100ms``: ``NVML_FI_DEV_POWER_INSTANT`` (field 186) every 50 / 100 ms;
- ``usage_50ms``: ``nvmlDeviceGetPowerUsage`` every 50 ms (on Ampere and newer, except GA100, that is the
  driver's 1 s average: what most scripts integrate without knowing it);
- ``usage_1s``: ``nvmlDeviceGetPowerUsage`` every second, for "1 s average power x time".

Each poll is (unix time, [mW per GPU]). Polling starts 1.5 s before T0 so every method has a reading at
T0. Results go to FILE as JSON. Only pynvml and the standard library are used; nothing is integrated here.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

FIELD_POWER_INSTANT = 186


def main(argv: Sequence[str] | None = None) -> int:
    import pynvml

    p = argparse.ArgumentParser(prog="python -m bench.nvml_poller")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--start", type=float, required=True)
    p.add_argument("--end", type=float, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(args.gpus)]

    def instant() -> list[int]:
        return [int(pynvml.nvmlDeviceGetFieldValues(h, [FIELD_POWER_INSTANT])[0].value.uiVal) for h in handles]

    def usage() -> list[int]:
        return [int(pynvml.nvmlDeviceGetPowerUsage(h)) for h in handles]

    results: dict[str, list[Any]] = {}

    def poll(name: str, interval: float, read: Callable[[], list[int]]) -> None:
        out: list[Any] = []
        results[name] = out
        next_t = args.start - 1.5
        while next_t <= args.end + interval:
            delay = next_t - time.time()
            if delay > 0:
                time.sleep(delay)
            t0 = time.time()
            values = read()
            out.append([(t0 + time.time()) / 2, values])
            next_t += interval
            if next_t < time.time():  # fell behind: skip, as a sleeping polling loop does
                next_t = time.time() + interval

    threads = [threading.Thread(target=poll, args=a, daemon=True) for a in (
        ("instant_50ms", 0.05, instant), ("instant_100ms", 0.1, instant), ("usage_50ms", 0.05, usage),
        ("usage_1s", 1.0, usage),
    )]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pynvml.nvmlShutdown()
    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
