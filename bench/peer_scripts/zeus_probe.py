"""Runs inside the Zeus venv (bench/peer_envs.py): ZeusMonitor measurement windows on the fake NVML library.

``windows``: consecutive windows of each length in --lengths (seconds) plus one window over the whole run,
from unix time --start to --end, on every GPU; each begin/end call is bracketed with time.time() so the
caller can compute the true energy over exactly what Zeus measured. ``timing``: seconds per
begin_window + end_window pair. Prints one JSON document. Imports only Zeus and the standard library.
sync_execution=False everywhere: there is no CUDA here (Zeus would call torch.cuda.synchronize).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from typing import Any


def _monitor(gpus: int) -> Any:
    from zeus.monitor import ZeusMonitor

    return ZeusMonitor(gpu_indices=list(range(gpus)), cpu_indices=[])


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


def windows(args: argparse.Namespace) -> dict[str, Any]:
    mon = _monitor(args.gpus)
    lengths = [int(x) for x in args.lengths.split(",")]
    duration = int(round(args.end - args.start))
    open_at: dict[str, float] = {}
    out: list[dict[str, Any]] = []

    def begin(key: str) -> None:
        t0 = time.time()
        mon.begin_window(key, sync_execution=False)
        open_at[key] = (t0 + time.time()) / 2

    def end(key: str, length: float) -> None:
        t0 = time.time()
        m = mon.end_window(key, sync_execution=False)
        out.append({"key": key, "length": length, "t0": open_at.pop(key), "t1": (t0 + time.time()) / 2,
                    "energy_j": [m.gpu_energy[i] for i in range(args.gpus)]})

    for k in range(duration + 1):
        _sleep_until(args.start + k)
        for length in lengths:
            if k % length == 0:
                if k >= length:
                    end(f"L{length}-{k - length}", length)
                if k + length <= duration:
                    begin(f"L{length}-{k}")
        if k == 0:
            begin("run")
        if k == duration:
            end("run", float(duration))
    return {"windows": out}


def timing(args: argparse.Namespace) -> dict[str, Any]:
    import pynvml

    mon = _monitor(args.gpus)
    rounds = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            mon.begin_window("w", sync_execution=False)
            mon.end_window("w", sync_execution=False)
        rounds.append((time.perf_counter() - t0) / args.calls)
    # What the library itself costs per energy read, to tell Zeus's own time from the (fake) driver's.
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    t0 = time.perf_counter()
    for _ in range(args.calls):
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    return {"pair_s": rounds, "energy_read_s": (time.perf_counter() - t0) / args.calls}


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("windows")
    w.add_argument("--gpus", type=int, required=True)
    w.add_argument("--start", type=float, required=True)
    w.add_argument("--end", type=float, required=True)
    w.add_argument("--lengths", default="1,5")
    t = sub.add_parser("timing")
    t.add_argument("--gpus", type=int, required=True)
    t.add_argument("--calls", type=int, default=2000)
    t.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("zeus").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")  # "energy measured as zero" for sub-update-period windows in timing mode
    import zeus

    result = windows(args) if args.mode == "windows" else timing(args)
    result["version"] = getattr(zeus, "__version__", "?")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
