"""``gpu-energy-exporter demo``: the whole product on any machine, without a GPU or a driver.

Starts a real exporter (the same ``Exporter`` the daemon runs, with the exporter's own flags) whose GPUs
are simulated (``devices/simulated.py``), plus a simulated trainer that pushes its counters through the
real training helper over OTLP to that exporter, exactly as a training script would. Runs alternate
between two backends (bitsandbytes and Unsloth profiles with different speed and power), each finishing
after ``--demo.run-duration`` and followed by an idle pause, so the run ledger fills with entries that
``runs``, ``top`` and ``report`` can show and compare.

Simulated data is always marked, so it can never be taken for a measurement: a "SIMULATED DATA" log line
and banner at start, ``backend="simulated"`` on ``gpuenergy_gpu_info`` / ``gpuenergy_nvml_info``, GPU
model names ending in "(simulated)", UUIDs starting with ``GPU-SIM``, ``"simulated": true`` in
``/api/v1/status`` and a "simulated" note on every demo run. This module must never load NVML or
report anything it did not simulate.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from gpu_energy_exporter.core.errors import ConfigError, ExporterError
from gpu_energy_exporter.core.flagparser import FlagParser
from gpu_energy_exporter.core.runs_schema import KEEP_FINISHED_S
from gpu_energy_exporter.daemon.config import (
    DEFAULT_METRICS_PORT,
    FLAGS,
    Config,
    add_exporter_flags,
    config_from_namespace,
    parse_duration,
)
from gpu_energy_exporter.http.listen import client_url

log = logging.getLogger(__name__)

#: The demo's own default for ``--runs.warmup`` (the daemon's is 30s): ledger figures appear quickly.
DEMO_WARMUP = "5s"
_WARMUP_FLAG = next(f for f in FLAGS if f.name == "runs.warmup")

SIMULATED_BANNER = (
    "SIMULATED DATA: gpu-energy-exporter demo serves simulated GPUs and a simulated training run; "
    "nothing it shows is a measurement"
)


@dataclass(frozen=True)
class Profile:
    """One simulated training setup. Figures are plausible for an 8B QLoRA fine-tune, not measured."""

    backend: str
    optimizer: str
    load: float  # fraction of the GPUs' dynamic power range
    step_s: float  # seconds per optimizer step
    batch_size: int
    grad_accum: int
    seq_len: int
    loss_floor: float


PROFILES: tuple[Profile, ...] = (
    Profile("bitsandbytes", "paged_adamw_8bit", load=0.86, step_s=1.2, batch_size=4, grad_accum=1, seq_len=1024,
            loss_floor=0.92),
    Profile("unsloth", "adamw_8bit", load=0.80, step_s=0.75, batch_size=4, grad_accum=1, seq_len=1024,
            loss_floor=0.90),
)
MODEL = "llama-3.1-8b"
PARAMETERS = 8.0e9


class SimulatedTrainer:
    """Pushes simulated runs through the training helper and drives the simulated GPUs' load.

    ``backend``: the ``SimulatedBackend`` (``set_load(index, load, pid)``); ``endpoint``: the exporter's
    OTLP base URL. Runs on its own thread (``start()``); ``stop()`` finishes the current run (its final
    export carries ``training_run_finished 1``) and returns when the thread ended.
    """

    def __init__(
        self,
        backend: Any,
        gpu_uuids: list[str],
        endpoint: str,
        *,
        run_duration: float = 180.0,
        pause: float = 20.0,
        runs: int = 0,
        export_interval: float = 2.0,
        headers: Mapping[str, str] | None = None,
        seed: int | None = None,
    ) -> None:
        self.backend = backend
        self.gpu_uuids = list(gpu_uuids)
        self.endpoint = endpoint
        self.run_duration = run_duration
        self.pause = pause
        self.runs = runs
        self.export_interval = export_interval
        self.headers = dict(headers) if headers else None
        self.started_runs: list[str] = []
        self.error: str | None = None  # why the trainer stopped early, if it did
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="demo-trainer", daemon=True)
        self.done = threading.Event()

    def start(self) -> SimulatedTrainer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            # Idle first: the exporter learns the GPUs' idle power, as the old tools' "baseline" phase did.
            if self._stop.wait(self.pause):
                return
            n = 0
            while not self._stop.is_set() and (self.runs <= 0 or n < self.runs):
                self._one_run(n, PROFILES[n % len(PROFILES)])
                n += 1
                if self._stop.wait(self.pause):
                    break
        except Exception as exc:  # noqa: BLE001 - the demo trainer must not kill the exporter it feeds
            # One readable line; the traceback only at debug level (--log.level=debug).
            why = f"{type(exc).__name__}: {exc}" + (f" ({exc.__cause__})" if exc.__cause__ else "")
            log.error("demo: the simulated trainer stopped (%s); no more simulated runs, the exporter keeps serving",
                      why)
            log.debug("demo: the simulated trainer's traceback", exc_info=True)
            self.error = why
        finally:
            try:
                self._set_load(0.0)
            finally:
                self.done.set()

    def _set_load(self, load: float) -> None:
        for i in range(len(self.gpu_uuids)):
            self.backend.set_load(i, load, os.getpid() if load > 0 else None)

    def _one_run(self, n: int, p: Profile) -> None:
        from gpu_energy_exporter.training import TrainingRun  # noqa: PLC0415 - needs the OTel SDK
        from gpu_energy_exporter.training.endpoint import resolve_endpoint  # noqa: PLC0415

        run_id = time.strftime("demo-%Y%m%d-%H%M%S-", time.localtime()) + p.backend
        total_steps = max(1, int(self.run_duration / p.step_s))
        tokens_per_step = p.batch_size * p.grad_accum * p.seq_len
        # TrainingRun directly rather than start_run(): the GPU-SIM UUIDs are not NVML UUIDs, and
        # start_run() would look them up in NVML and warn that it cannot map them.
        run = TrainingRun(
            run_id=run_id, rank=0, world_size=1, gpu_uuids=self.gpu_uuids, gpu_label=",".join(self.gpu_uuids),
            metadata={"model": MODEL, "backend": p.backend, "optimizer": p.optimizer, "batch_size": p.batch_size,
                      "grad_accum": p.grad_accum, "seq_len": p.seq_len, "precision": "bf16", "seed": 42 + n,
                      "notes": "simulated by gpu-energy-exporter demo"},
            total_steps=total_steps, endpoint=resolve_endpoint(self.endpoint), headers=self.headers,
            export_interval=self.export_interval, export_timeout=5.0, finish_timeout=5.0,
        )
        self.started_runs.append(run_id)
        log.info("demo: simulated run %s started (%s, %d steps of %d tokens planned, ~%.0fs)", run_id, p.backend,
                 total_steps, tokens_per_step, total_steps * p.step_s)
        self._set_load(p.load)
        run.flush(timeout=5.0)  # the ledger starts the run at its first point: push one now
        try:
            for step in range(total_steps):
                pace = p.step_s * self._rng.uniform(0.9, 1.1)
                if self._stop.wait(pace):
                    break
                run.step(tokens=tokens_per_step, samples=p.batch_size * p.grad_accum,
                         loss=self._loss(step, total_steps, p), lr=_lr(step, total_steps),
                         flops=6.0 * PARAMETERS * tokens_per_step, duration_s=pace)
                if (step + 1) % max(1, total_steps // 4) == 0:
                    run.epoch((step + 1) / total_steps, val_loss=self._loss(step, total_steps, p) + 0.05)
        finally:
            run.finish(timeout=5.0)
            self._set_load(0.0)
        log.info("demo: simulated run %s finished after %d steps (%d exports delivered, %d dropped)", run_id,
                 run.steps, run.delivered_exports, run.dropped_exports)

    def _loss(self, step: int, total: int, p: Profile) -> float:
        progress = step / max(1, total)
        return p.loss_floor + 1.7 * math.exp(-5.0 * progress) + self._rng.gauss(0.0, 0.03)


#: the simulated vLLM server's GPU load (a steady serving load, below the trainer's)
SERVING_LOAD = 0.55


class ServingSimError(ExporterError):
    """The simulated vLLM server did not start."""


class ServingSim:
    """The simulated vLLM server (``tools/serving_sim.py``), a process of its own: its pid is the one the
    simulated GPU lists, as a real server's would be, and the one listening on its port."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def flags(self) -> list[str]:
        return ["--collector.inference", f"--collector.inference.url={self.url}", "--collector.inference.interval=2s"]

    @classmethod
    def start(cls, timeout_s: float = 20.0) -> ServingSim:
        proc = subprocess.Popen([sys.executable, "-m", "gpu_energy_exporter.tools.serving_sim"],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        line = got[0].strip() if got else ""
        if not line.isdigit():
            proc.kill()
            proc.wait()
            raise ServingSimError(f"the demo's simulated vLLM server did not start within {timeout_s:g}s "
                                  "(run the demo with --no-demo.serving to go without it)")
        log.info("demo: simulated vLLM server (pid %d) on %s", proc.pid, f"http://127.0.0.1:{line}/metrics")
        return cls(proc, int(line))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _lr(step: int, total: int, peak: float = 2e-4, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# ----------------------------------------------------------------------------------------------------
# command line


def new_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="gpu-energy-exporter demo",
        description="Start the exporter with SIMULATED GPUs (no driver needed) and a simulated training run "
                    "pushing through OTLP, to see every metric, the run ledger, `top` and `report` on any "
                    "machine. Simulated data is always marked as such.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""examples:
  gpu-energy-exporter demo                                   :9863/metrics, OTLP on localhost:4318
  gpu-energy-exporter demo --demo.gpus 4 --demo.run-duration 1m
  gpu-energy-exporter demo --web.listen-address=:9864 --otlp.listen-address=localhost:4319 --runs.csv=demo-runs.csv
then, in another terminal: gpu-energy-exporter top
The demo's --runs.warmup defaults to {DEMO_WARMUP} (the exporter's: {_WARMUP_FLAG.default}) for quick ledger figures.
""")
    demo = parser.add_argument_group("demo")
    demo.add_argument("--demo.gpus", dest="demo_gpus", type=int, default=2, metavar="N",
                      help="number of simulated GPUs (default: 2)")
    demo.add_argument("--demo.run-duration", dest="demo_run_duration", default="3m", metavar="DURATION",
                      help="length of each simulated training run (default: 3m)")
    demo.add_argument("--demo.pause", dest="demo_pause", default="20s", metavar="DURATION",
                      help="idle time before the first run and between runs (default: 20s; the exporter "
                           "learns the idle power then)")
    demo.add_argument("--demo.runs", dest="demo_runs", type=int, default=0, metavar="N",
                      help="stop starting runs after N (default: 0, keep going)")
    demo.add_argument("--demo.serving", dest="demo_serving", action=argparse.BooleanOptionalAction, default=True,
                      help="a simulated vLLM server on the last simulated GPU, scraped by the inference collector: "
                           "a serving session beside the training runs (default: on with 2 GPUs or more)")
    demo.add_argument("--demo.export-interval", dest="demo_export_interval", default="2s", metavar="DURATION",
                      help="how often the simulated trainer pushes (default: 2s; real trainers: 10s)")
    add_exporter_flags(parser)
    return parser


@dataclass(frozen=True)
class DemoOptions:
    gpus: int
    run_duration: float
    pause: float
    runs: int
    export_interval: float
    serving: bool = False  # a simulated vLLM server on the last GPU (the trainer gets the others)


def parse_args(argv: list[str], environ: Mapping[str, str]) -> tuple[Config, DemoOptions]:
    """Flags to (exporter config, demo options); ConfigError for a bad value. ``--help`` exits."""
    ns = new_parser().parse_args(argv)
    if getattr(ns, _WARMUP_FLAG.dest, None) is None and _WARMUP_FLAG.env not in environ:
        setattr(ns, _WARMUP_FLAG.dest, DEMO_WARMUP)
    config = config_from_namespace(ns, environ)
    if not 1 <= ns.demo_gpus <= 16:
        raise ConfigError(f"--demo.gpus must be between 1 and 16, got {ns.demo_gpus}")
    if ns.demo_runs < 0:
        raise ConfigError("--demo.runs must be 0 (keep going) or a positive number")
    durations = {}
    for flag, raw in (("demo.run-duration", ns.demo_run_duration), ("demo.pause", ns.demo_pause),
                      ("demo.export-interval", ns.demo_export_interval)):
        try:
            durations[flag] = parse_duration(raw)
        except ValueError as exc:
            raise ConfigError(f"invalid value {raw!r} for --{flag}: {exc}") from None
    if durations["demo.run-duration"] < 1:
        raise ConfigError("--demo.run-duration must be at least 1s")
    if durations["demo.export-interval"] < 0.1:
        raise ConfigError("--demo.export-interval must be at least 100ms")
    if not config.enabled("gpu"):
        raise ConfigError("the demo simulates GPUs: do not pass --no-collector.gpu")
    return config, DemoOptions(ns.demo_gpus, durations["demo.run-duration"], durations["demo.pause"], ns.demo_runs,
                               durations["demo.export-interval"], ns.demo_serving and ns.demo_gpus >= 2)


def training_helper_missing() -> str | None:
    """None when the training helper (the OpenTelemetry SDK and its OTLP/HTTP exporter) can be imported,
    else what to do: the simulated trainer pushes through it, exactly as a training script does."""
    try:
        import gpu_energy_exporter.training.run  # noqa: F401, PLC0415
    except ImportError as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
        return (f"the demo's simulated trainer pushes through the training helper, which needs the OpenTelemetry "
                f"SDK and its OTLP/HTTP exporter ({cause}). Install them into this environment: "
                f"`{sys.executable} -m pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http` "
                "(or reinstall gpu-energy-exporter: they are part of its base install)")
    return None


def _url_flag(web_url: str) -> str:
    """`` --url URL`` when the commands' default (http://localhost:9863) would not reach the demo, else "":
    localhost resolves to ::1 and 127.0.0.1 and the client tries both, so any loopback or wildcard listener
    on the default port is reached without it."""
    parts = urllib.parse.urlsplit(web_url)
    loopback = parts.hostname in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")
    return "" if loopback and parts.port == DEFAULT_METRICS_PORT else f" --url {web_url}"


def next_steps(web_url: str, otlp_url: str, telemetry_path: str, opts: DemoOptions, runs_csv: str | None,
               gpus: int) -> str:
    url = _url_flag(web_url)
    lines = [
        "",
        f"  {SIMULATED_BANNER}.",
        f"  {gpus} simulated GPU(s); a simulated training run starts in {opts.pause:g}s and lasts "
        f"{opts.run_duration:g}s, then the next one (backends alternate: bitsandbytes, unsloth)"
        + (f", on GPU(s) 0-{gpus - 2}; a simulated vLLM server serves on GPU {gpus - 1} (a serving session)."
           if opts.serving else "."),
        "",
        f"  metrics        {web_url}{telemetry_path}",
        f"  JSON API       {web_url}/api/v1/status   {web_url}/api/v1/runs",
        f"  OTLP receiver  {otlp_url}/v1/metrics   (the simulated trainer pushes here; a real script can too)",
        "",
        "  next, in another terminal:",
    ]
    commands = [
        (f"gpu-energy-exporter top{url}", "live view of GPUs, runs and host RAM"),
        (f"gpu-energy-exporter runs{url}",
         f"the run ledger (first run done in ~{opts.pause + opts.run_duration:.0f}s)"),
        (f"gpu-energy-exporter report{url} RUN_ID", "a report with plots for one run (RUN_ID: first column of runs)"),
    ]
    width = max(len(c) for c, _ in commands)
    lines += [f"    {c.ljust(width)}   {what}" for c, what in commands]
    keep = f"{KEEP_FINISHED_S / 60:g} minutes"
    if runs_csv is None:
        lines.append(f"  finished runs stay in `runs` and `report` for {keep}; add --runs.csv=demo-runs.csv to keep "
                     "them on disk (CSV + JSON summaries)")
    else:
        lines.append(f"  finished runs stay in `runs --url` and `report` for {keep}, and in {runs_csv} for good "
                     f"(`runs --csv {runs_csv}`, `report` on its JSON summaries)")
    lines += ["  Ctrl-C stops the demo.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str], *, stdout: IO[str] | None = None, environ: Mapping[str, str] | None = None,
         install_signals: bool = True, ready: Callable[[Any], None] | None = None,
         stop: threading.Event | None = None) -> int:
    """Run the demo until SIGTERM/SIGINT (or ``stop`` is set). ``ready`` is called with the started
    exporter (for embedding)."""
    from gpu_energy_exporter.daemon.exporter import Exporter  # noqa: PLC0415
    from gpu_energy_exporter.daemon.logsetup import setup_logging  # noqa: PLC0415
    from gpu_energy_exporter.devices.simulated import SimulatedBackend  # noqa: PLC0415
    from gpu_energy_exporter.otlp.receiver import load_bearer_tokens  # noqa: PLC0415

    out = stdout if stdout is not None else sys.stdout
    env = os.environ if environ is None else environ
    try:
        config, opts = parse_args(argv, env)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return int(exc.code or 0)
    except ConfigError as exc:
        print(f"gpu-energy-exporter demo: error: {exc}", file=sys.stderr)
        return 2
    missing = training_helper_missing()
    if missing is not None:
        print(f"gpu-energy-exporter demo: error: {missing}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    log.warning("%s (%d simulated GPUs, backend=\"simulated\")", SIMULATED_BANNER, opts.gpus)
    backend = SimulatedBackend(opts.gpus)
    server: ServingSim | None = None
    try:
        if opts.serving:
            # The server first: the inference collector is pointed at its port (the user's flags come after
            # the demo's, so theirs win).
            server = ServingSim.start()
            config, _ = parse_args([*server.flags(), *argv], env)
            backend.set_load(opts.gpus - 1, SERVING_LOAD, server.pid)
        exporter = Exporter(config, backend_factory=lambda: backend)
        headers = None
        if config.otlp_bearer_token_file:
            # the first token in the file (per-tenant files: the first tenant's)
            headers = {"Authorization": "Bearer " + next(iter(load_bearer_tokens(config.otlp_bearer_token_file)))}
    except (ConfigError, ServingSimError) as exc:
        print(f"gpu-energy-exporter demo: error: {exc}", file=sys.stderr)
        if server is not None:
            server.stop()
        return 2
    stop = stop or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if install_signals:
        def on_signal(signum: int, _frame: object) -> None:
            if not stop.is_set():
                log.info("received %s, stopping the demo", signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    trainer: SimulatedTrainer | None = None
    try:
        try:
            exporter.start()
        except ExporterError as exc:
            print(f"gpu-energy-exporter demo: error: {exc}", file=sys.stderr)
            exporter.stop()
            if server is not None:
                server.stop()
            return 1
        assert exporter.web is not None
        web_url = exporter.web.url
        otlp_url = client_url(exporter.otlp.server_address)
        uuids = [g.uuid for g in backend.devices()][:opts.gpus - 1 if opts.serving else None]
        trainer = SimulatedTrainer(backend, uuids, otlp_url, run_duration=opts.run_duration, pause=opts.pause,
                                   runs=opts.runs, export_interval=opts.export_interval, headers=headers).start()
        out.write(next_steps(web_url, otlp_url, config.web_telemetry_path, opts, config.runs_csv, opts.gpus))
        out.flush()
        if ready is not None:
            ready(exporter)
        while not stop.wait(0.5):
            pass
    finally:
        # The trainer first: its final export (training_run_finished 1) must reach a running receiver.
        if trainer is not None:
            trainer.stop()
        if exporter.web is not None:
            exporter.stop()
        if server is not None:
            server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("demo stopped")
    return 0


__all__ = ["PROFILES", "SIMULATED_BANNER", "DemoOptions", "SimulatedTrainer", "main", "new_parser", "parse_args"]
