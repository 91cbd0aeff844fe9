"""Logging in the Prometheus exporters' style: logfmt (default) or JSON lines on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time

from gpu_energy_exporter.core.textfmt import printable

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}
_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
          logging.CRITICAL: "error"}


def _ts(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _quote(value: str) -> str:
    if value and not any(c in value for c in ' "=\n\t'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # pushed values (run ids, labels) are quoted in messages: no ESC or BEL reaches a terminal tailing the log
        msg = printable(record.getMessage())
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return (f"ts={_ts(record)} level={_NAMES.get(record.levelno, 'info')} "
                f"source={record.name.removeprefix('gpu_energy_exporter.')} msg={_quote(msg)}")


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": _ts(record), "level": _NAMES.get(record.levelno, "info"),
               "source": record.name.removeprefix("gpu_energy_exporter."), "msg": printable(record.getMessage())}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level, logging.INFO))
    # Third-party libraries stay at warning unless we debug.
    for noisy in ("urllib3", "grpc", "opentelemetry"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
