"""Command line: ``gpu-energy-exporter [flags]`` serves; sub-commands do the rest.

Sub-commands are imported lazily so that ``gpu-energy-exporter --help`` and the daemon never import
what only one sub-command needs (matplotlib for ``report``, curses for ``top``); the daemon's own modules are
imported by ``main`` too, after it chose how prometheus_client is loaded (``daemon/lean_imports.py``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.errors import ExporterError

log = logging.getLogger(__name__)

#: sub-command -> (module with ``main(argv) -> int``, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "runs": ("gpu_energy_exporter.client.runs", "list and compare finished training runs from the run ledger"),
    "top": ("gpu_energy_exporter.client.top", "live terminal view of a running exporter"),
    "report": ("gpu_energy_exporter.client.report", "per-run report (Markdown + HTML) with PNG plots"),
    "demo": ("gpu_energy_exporter.tools.demo", "start the exporter with simulated GPUs and a simulated training run"),
}

_EPILOG = "sub-commands (each has its own --help):\n" + "\n".join(
    f"  {name:<8} {desc}" for name, (_, desc) in SUBCOMMANDS.items()
) + """

examples:
  gpu-energy-exporter                              serve :9863/metrics and OTLP on localhost:4318
  gpu-energy-exporter --otlp.listen-address=:4318 --runs.csv=/var/lib/gpu-energy-exporter/runs.csv
  gpu-energy-exporter demo                         try it without a GPU
docs: https://github.com/gpu-energy-exporter/gpu-energy-exporter/tree/main/docs
"""


#: NVML's reasons (``gpuenergy_nvml_available{reason}``) that mean "no NVIDIA driver on this machine", as
#: opposed to a permission or version problem: most likely a laptop or CI box without a GPU.
NO_DRIVER_REASONS = ("library_not_found", "driver_not_loaded")
#: Said after NVML's own warning when there is no driver: the way to try the exporter anyway.
NO_GPU_HINT = ("no NVIDIA driver here: to try gpu-energy-exporter without a GPU, run `gpu-energy-exporter demo` "
               "(simulated GPUs and a simulated training run; from a checkout: make run ARGS=demo)")


def new_parser() -> argparse.ArgumentParser:
    from gpu_energy_exporter.daemon.config import new_parser as config_parser

    parser = config_parser()
    parser.description = (
        "Prometheus exporter for GPU energy, power, utilisation and the training runs that use them. Serves "
        "/metrics, receives OpenTelemetry (OTLP/HTTP) pushes from training processes and keeps a per-run "
        "energy ledger."
    )
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--version", action="version", version=f"gpu-energy-exporter {__version__}")
    return parser


def serve(argv: Sequence[str], *, backend_factory: object = None) -> int:
    """Parse flags, start the exporter, run until SIGTERM/SIGINT."""
    from gpu_energy_exporter.daemon.config import config_from_namespace
    from gpu_energy_exporter.daemon.exporter import Exporter
    from gpu_energy_exporter.daemon.inertflags import inert_flags
    from gpu_energy_exporter.daemon.lean_imports import few_malloc_arenas
    from gpu_energy_exporter.daemon.logsetup import setup_logging

    few_malloc_arenas()  # before any thread starts (daemon/lean_imports.py says why)
    try:
        ns = new_parser().parse_args(list(argv))
        config = config_from_namespace(ns, os.environ)
        setup_logging(config.log_level, config.log_format)
        for warning in inert_flags(ns, os.environ, config):
            log.warning("%s", warning)
        exporter = Exporter(config, backend_factory=backend_factory)  # type: ignore[arg-type]
    except ExporterError as exc:
        print(f"gpu-energy-exporter: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            return
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        exporter.start()
    except ExporterError as exc:
        log.error("%s", exc)
        exporter.stop()
        return 1
    if exporter.gpu is not None and exporter.gpu.unavailable_reason in NO_DRIVER_REASONS:
        log.warning("%s", NO_GPU_HINT)  # the first sample is taken: NVML has said why it is unavailable
    _freeze_startup_heap()
    try:
        # No timeout: a signal interrupts the wait (POSIX), and waking every second cost 0.01% of a core.
        stop.wait()
    finally:
        exporter.stop()
    log.info("stopped")
    return 0


def _freeze_startup_heap() -> None:
    """Move everything alive after start-up (modules, the metric catalogue, protobuf and gRPC descriptors,
    the first snapshot) out of the garbage collector's view. Those objects live as long as the process, yet
    every full collection walked all of them again: with 8 GPUs, the collections that the per-sample
    allocations trigger were a third of the gpu collector's Python CPU (perf). Objects made later are
    collected as before."""
    gc.collect()
    gc.freeze()


def main(argv: Sequence[str] | None = None) -> int:
    """The process's entry point (the console script and ``python -m gpu_energy_exporter``)."""
    from gpu_energy_exporter.daemon.lean_imports import lean_prometheus_client

    # This process's own choice, before anything imports prometheus_client: its submodules without the
    # package __init__'s HTTP servers and OpenSSL (6.4 MB of the daemon's RSS; daemon/lean_imports.py). Importing
    # the package as a library (tests, a notebook) changes nothing.
    lean_prometheus_client()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[args[0]][0])
        try:
            return int(module.main(args[1:]))
        except ExporterError as exc:
            print(f"gpu-energy-exporter {args[0]}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    return serve(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
