"""Run a Python module under cProfile in *every* thread: ``python -m bench.profiled OUTDIR MODULE [ARGS...]``.

``python -m cProfile`` only sees the main thread, and the exporter does its work in others (one thread per
HTTP connection, one per collector). This launcher wraps ``threading.Thread.run`` so each thread gets its
own ``cProfile.Profile``; when a thread ends, its figures are merged into the group of its thread name (the
web server names connection threads ``<server>-conn``). At exit (the module's ``main`` returned, e.g. after
SIGTERM) the threads still running are added too, and each group is written to ``OUTDIR/<group>.prof``
(``pstats`` format: ``python -m pstats FILE``, snakeviz, or gprof2dot for a call graph) plus everything
merged in ``OUTDIR/all.prof``.

Only for the benchmarks' ``--profile`` options: the profiler slows every Python call, so timings taken
while it runs mean nothing; the split of the time between functions is what it is for.
"""

from __future__ import annotations

import atexit
import cProfile
import pstats
import re
import runpy
import sys
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_done: dict[str, list[dict[Any, Any]]] = {}
_live: dict[int, tuple[str, cProfile.Profile]] = {}


class _Snapshot:
    """What ``pstats.Stats`` accepts: an object with ``create_stats()`` and ``stats``."""

    def __init__(self, stats: dict[Any, Any]) -> None:
        self.stats = stats

    def create_stats(self) -> None:
        pass


def group_of(thread_name: str) -> str:
    """``otlp-conn`` for ``otlp-conn``; ``Thread-12 (x)`` -> ``Thread``: numbers dropped so threads pool."""
    name = re.sub(r"[-_ ]?\d+", "", thread_name.split(" (")[0]) or "thread"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _keep(group: str, prof: cProfile.Profile) -> None:
    prof.snapshot_stats()
    with _lock:
        _done.setdefault(group, []).append(prof.stats)


def _patch_threads() -> None:
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        with _lock:
            _live[id(prof)] = (group_of(self.name), prof)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()
            with _lock:
                _live.pop(id(prof), None)
            _keep(group_of(self.name), prof)

    threading.Thread.run = run  # type: ignore[method-assign]


def _write(outdir: Path, main_prof: cProfile.Profile) -> None:
    main_prof.disable()
    _keep("main", main_prof)
    with _lock:
        live = list(_live.values())
    for group, prof in live:  # still running (daemon threads): what they did so far
        try:
            _keep(group, prof)
        except Exception:  # noqa: BLE001 - a thread racing us must not lose the other groups
            pass
    outdir.mkdir(parents=True, exist_ok=True)
    everything: pstats.Stats | None = None
    with _lock:
        groups = {g: list(v) for g, v in _done.items()}
    for group, parts in groups.items():
        stats = pstats.Stats(_Snapshot(parts[0]))  # type: ignore[arg-type]
        for part in parts[1:]:
            stats.add(_Snapshot(part))  # type: ignore[arg-type]
        stats.dump_stats(str(outdir / f"{group}.prof"))
        if everything is None:
            everything = pstats.Stats(_Snapshot(parts[0]))  # type: ignore[arg-type]
            rest = parts[1:]
        else:
            rest = parts
        for part in rest:
            everything.add(_Snapshot(part))  # type: ignore[arg-type]
    if everything is not None:
        everything.dump_stats(str(outdir / "all.prof"))


#: Frames that only wrap a connection's life or wait for its next request (idle time, not work).
IDLE = (r"threading\.py:\d+\((run|_bootstrap\w*)\)|web\.py:\d+\((_serve_connection|__init__|handle_one_request)\)"
        r"|socketserver\.py|http/server\.py:\d+\(handle\)|\(readline\)|'readline'|\(readinto\)|recv_into"
        r"|'poll' of|select\.py|selectors\.py|\(serve_forever\)"
        # gpu_energy_exporter/http/server.py: the selector loop and a worker's wait for its next job
        r"|gpu_energy_exporter/http/server\.py:\d+\((_loop|_work)\)|'get' of '_queue")


def _short(func: tuple[str, int, str]) -> str:
    path, line, name = func
    path = re.sub(r".*/(site-packages|lib/python3\.\d+)/", "", path)
    path = re.sub(r".*/(gpu_energy_exporter|bench)/", r"\1/", path)
    return f"{path}:{line}({name})" if line else name


def top(path: Path, n: int = 15, exclude: str = IDLE) -> str:
    """The ``n`` functions with the most cumulative time in a ``.prof`` file, leaving out ``exclude``
    (by default the frames that only wait for a connection's next request), one per line."""
    stats = pstats.Stats(str(path))
    stats.sort_stats("cumulative")
    skip = re.compile(exclude) if exclude else None
    rows = []
    for func in stats.fcn_list:  # type: ignore[attr-defined]
        name = _short(func)
        if skip is not None and skip.search(name):
            continue
        _cc, nc, tt, ct, _callers = stats.stats[func]  # type: ignore[attr-defined]
        rows.append(f"{nc:>9} {tt:9.3f} {ct:9.3f} {ct / nc * 1e3 if nc else 0:11.3f}  {name}")
        if len(rows) >= n:
            break
    head = f"{'ncalls':>9} {'tottime':>9} {'cumtime':>9} {'ms/call cum':>11}  function (seconds under cProfile)"
    return "\n".join([head, *rows]) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m bench.profiled OUTDIR MODULE [ARGS...]")
    outdir, module, args = Path(argv[0]), argv[1], argv[2:]
    _patch_threads()
    prof = cProfile.Profile()
    atexit.register(_write, outdir, prof)
    sys.argv = [module, *args]
    prof.enable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
