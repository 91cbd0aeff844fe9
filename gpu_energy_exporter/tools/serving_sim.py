"""A simulated vLLM server for ``gpu-energy-exporter demo``: a small process whose ``/metrics`` shows vLLM's token
and request counters (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` with the labels
``model_name`` and ``engine``, ``vllm:request_success_total`` per ``finished_reason``: the names, types and labels
of vllm/v1/metrics/loggers.py) growing at a steady made-up rate, so that the demo's inference collector finds a
serving session (docs/inference.md, Without Prometheus).

Run as ``python -m gpu_energy_exporter.tools.serving_sim [--port N]``: it listens on 127.0.0.1 only, prints
its port on the first line of stdout and serves until SIGTERM or SIGINT. Its figures are made up (the model
name says "(simulated)"); it serves nothing else, never loads a model and imports nothing of the exporter.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "llama-3.1-8b-instruct (simulated)"
#: steady made-up rates, per second: a small chat server's (an 8B model on one H100 serves far more at peak)
PROMPT_PER_S, OUTPUT_PER_S, REQUESTS_PER_S = 2400.0, 600.0, 2.5


def exposition(elapsed: float, model: str = MODEL) -> str:
    """What /metrics answers ``elapsed`` seconds after the server started (prometheus_client's text format)."""
    prompt, output = int(PROMPT_PER_S * elapsed), int(OUTPUT_PER_S * elapsed)
    requests = int(REQUESTS_PER_S * elapsed)
    length = requests // 5  # one request in five stops at its length limit
    labels = f'engine="0",model_name="{model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {min(8.0, REQUESTS_PER_S * 3):.1f}\n"
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        f"vllm:prompt_tokens_total{{{labels}}} {float(prompt)}\n"
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        f"vllm:generation_tokens_total{{{labels}}} {float(output)}\n"
        "# HELP vllm:request_success_total Count of successfully processed requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        f'vllm:request_success_total{{{labels},finished_reason="stop"}} {float(requests - length)}\n'
        f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(length)}\n'
        f'vllm:request_success_total{{{labels},finished_reason="abort"}} 0.0\n'
    )


def serve(port: int = 0) -> ThreadingHTTPServer:
    """A server on 127.0.0.1:``port`` (0: any free port), not yet serving."""
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = exposition(time.monotonic() - started).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_energy_exporter.tools.serving_sim",
                                     description="A simulated vLLM /metrics for gpu-energy-exporter demo.")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free port)")
    args = parser.parse_args(argv)
    server = serve(args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    print(server.server_address[1], flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
