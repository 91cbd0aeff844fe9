"""OTLP receiver, in process: microseconds per point by stage (decode + translate, + store, + a listener,
+ the run ledger, + the ledger on the steady clock as in the daemon), and the ledger alone replaying
pre-built events. Where ``bench.otlp_throughput``'s first rows spend their time, one stage at a time.

One thread, protobuf bodies of one helper-like rank per request (``bench.trainers.Trainer``), a fresh
store (and ledger) per pass; CPU time of the thread (``time.thread_time``). Each stage is measured in
``--rounds`` alternating passes and the median is printed, so a busy machine moves every stage alike.

Run: ``PYTHONPATH=$PWD python -m bench.otlp_stages [--seconds S] [--rounds N]``. Never asserts a figure.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.trainers import Trainer

RANKS = 80
PEER = "127.0.0.1:40000"


def _bodies(n_rounds: int) -> list[tuple[bytes, int]]:
    trainers = [Trainer(f"st-{i // 8}", i % 8) for i in range(RANKS)]
    return [t.request() for _ in range(n_rounds) for t in trainers]


def _stages() -> dict[str, Callable[[], Callable[[bytes], Any]]]:
    from gpu_energy_exporter.ledger import RunLedger
    from gpu_energy_exporter.otlp.receiver import decode_wire
    from gpu_energy_exporter.otlp.store import TrainingStore
    from gpu_energy_exporter.otlp.translate import translate_request

    ct = "application/x-protobuf"
    with_peer = "peer" in inspect.signature(translate_request).parameters

    def translate(body: bytes, limits: Any) -> Any:
        req = decode_wire(body, ct)
        if with_peer:
            return translate_request(req, time.time_ns(), limits, PEER)
        return translate_request(req, time.time_ns(), limits)

    def store_stage(listener: Callable[[], Callable[[Any], None] | None]) -> Callable[[], Callable[[bytes], Any]]:
        def make() -> Callable[[bytes], Any]:
            store = TrainingStore(max_series=10**6, max_series_per_run=10**6)
            fn = listener()
            if fn is not None:
                store.add_batch_listener(fn)
            limits = store.limits
            return lambda body: store.apply(translate(body, limits))
        return make

    def translate_only() -> Callable[[bytes], Any]:
        limits = TrainingStore().limits
        return lambda body: translate(body, limits)

    stages = {
        "decode + translate": translate_only,
        "+ store": store_stage(lambda: None),
        "+ a listener (AcceptedPoint events)": store_stage(lambda: lambda events: None),
        "+ the run ledger (on_points)": store_stage(lambda: RunLedger(None).on_points),
        "+ the ledger on the steady clock (daemon)": store_stage(
            lambda: RunLedger(None, clock=time.monotonic, wall=time.time).on_points),
    }
    if "wall" not in inspect.signature(RunLedger).parameters:  # older code (comparisons): no steady clock
        del stages["+ the ledger on the steady clock (daemon)"]
    return stages


def _measure(make: Callable[[], Callable[[bytes], Any]], bodies: list[tuple[bytes, int]], seconds: float) -> float:
    """µs of thread CPU per point."""
    cpu = 0.0
    points = 0
    while cpu < seconds:
        fn = make()
        c0 = time.thread_time()
        for body, n in bodies:
            fn(body)
            points += n
        cpu += time.thread_time() - c0
    return cpu / points * 1e6


def _replay(bodies: list[tuple[bytes, int]], seconds: float, steady: bool) -> float:
    """µs per point of the run ledger alone, fed the events the store made (pre-built)."""
    from gpu_energy_exporter.ledger import RunLedger
    from gpu_energy_exporter.otlp.receiver import decode_wire
    from gpu_energy_exporter.otlp.store import TrainingStore
    from gpu_energy_exporter.otlp.translate import translate_request

    store = TrainingStore(max_series=10**6, max_series_per_run=10**6)
    requests: list[list[Any]] = []
    store.add_batch_listener(lambda events: requests.append(list(events)))
    with_peer = "peer" in inspect.signature(translate_request).parameters
    for body, _ in bodies:
        req = decode_wire(body, "application/x-protobuf")
        args = (PEER,) if with_peer else ()
        store.apply(translate_request(req, time.time_ns(), store.limits, *args))
    n = sum(map(len, requests))
    cpu = 0.0
    points = 0
    while cpu < seconds:
        ledger = RunLedger(None, clock=time.monotonic, wall=time.time) if steady else RunLedger(None)
        c0 = time.thread_time()
        for events in requests:
            ledger.on_points(events)
        cpu += time.thread_time() - c0
        points += n
    return cpu / points * 1e6


def _ledger_class() -> Any:
    from gpu_energy_exporter.ledger import RunLedger

    return RunLedger


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="thread CPU seconds per stage and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (the median is printed)")
    ap.add_argument("--exports", type=int, default=10, help="successive exports of each of the 80 ranks per pass")
    ap.add_argument("--only", default="", help="only the stages whose name contains this text")
    args = ap.parse_args()
    bodies = _bodies(args.exports)
    stages = {k: v for k, v in _stages().items() if args.only in k}
    figures: dict[str, list[float]] = {name: [] for name in stages}
    replay = not args.only or args.only in "ledger alone"
    if replay:
        figures["ledger alone, replaying the store's events"] = []
    steady = replay and "wall" in inspect.signature(_ledger_class()).parameters
    if steady:
        figures["ledger alone, steady clock"] = []
    for _ in range(args.rounds):
        for name, make in stages.items():
            figures[name].append(_measure(make, bodies, args.seconds))
        if replay:
            figures["ledger alone, replaying the store's events"].append(_replay(bodies, args.seconds, False))
        if steady:
            figures["ledger alone, steady clock"].append(_replay(bodies, args.seconds, True))
    print(f"| stage ({RANKS} ranks x {args.exports} exports, 1 rank per request) | µs per point (median) | runs |")
    print("|---|---:|---|")
    for name, xs in figures.items():
        print(f"| {name} | {statistics.median(xs):.2f} | {' '.join(f'{x:.2f}' for x in xs)} |")


if __name__ == "__main__":
    main()
