"""Flag value parsers: each takes the raw string of a flag or environment variable and returns the value,
or raises ValueError with a reason that ``daemon.config`` puts in one clear message (flag, variable, what is
accepted); and ``Flag`` / ``CollectorFlag``, the declaration of one flag (its environment variable, its
collector). Pure functions, no I/O but the existence checks of files and directories.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(raw: str) -> float:
    """Prometheus-style duration (``100ms``, ``1s``, ``5m``, ``1h30m``) to seconds. A bare number is refused
    (is ``5`` seconds or minutes?), except ``0``, as Prometheus does."""
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if value == 0:
            return 0.0
        if value < 0 or math.isnan(value) or math.isinf(value):
            raise ValueError("must be a positive duration with a unit (examples: 100ms, 1s, 5m, 1h)")
        raise ValueError(f"needs a unit: durations take Prometheus' form, e.g. {text}s for {text} seconds "
                         f"(100ms, 1s, 5m, 1h)")
    total = 0.0
    rest = text
    matched = False
    for part in re.findall(r"\d+(?:\.\d+)?(?:ms|s|m|h|d)", text):
        m = _DURATION_RE.match(part)
        assert m is not None
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        rest = rest.replace(part, "", 1)
        matched = True
    if not matched or rest:
        raise ValueError("is not a duration (examples: 100ms, 1s, 5m, 1h)")
    return total


def parse_listen_address(raw: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6]:port``."""
    text = raw.strip()
    m = re.match(r"^\[([0-9a-fA-F:.]+)\]:(\d+)$", text) or re.match(r"^([^:\[\]]*):(\d+)$", text)
    if not m:
        raise ValueError("must be host:port, :port or [ipv6]:port")
    host, port = m.group(1), int(m.group(2))
    if not 0 <= port <= 65535:
        raise ValueError("port must be between 0 and 65535")
    return host, port


def parse_optional_listen_address(raw: str) -> tuple[str, int] | None:
    """``parse_listen_address``, or ``None`` (off) for an empty value."""
    return parse_listen_address(raw) if raw.strip() else None


def parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or math.isinf(value):
        raise ValueError("must be a positive number")
    return value


def non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or math.isinf(value):
        raise ValueError("must be zero or a positive number")
    return value


def positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return raw

    return parse


def existing_file(raw: str) -> str:
    if not os.path.isfile(raw):
        raise ValueError(f"file {raw!r} does not exist")
    return raw


def existing_dir(raw: str) -> str:
    if not os.path.isdir(raw):
        raise ValueError(f"directory {raw!r} does not exist")
    return raw


def any_text(raw: str) -> str:
    return raw


def http_url(raw: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL, e.g. http://collector:4318/v1/metrics")
    return raw.strip()


# ----------------------------------------------------------------------------------------------------
# a flag's declaration (the table is daemon.config's FLAGS; a collector's own, its CollectorSpec's)

ENV_PREFIX = "GPU_ENERGY_EXPORTER_"


def env_of(flag_name: str) -> str:
    """The environment variable of ``--<flag_name>``: ``runs.csv`` -> ``GPU_ENERGY_EXPORTER_RUNS_CSV``."""
    return ENV_PREFIX + flag_name.replace(".", "_").replace("-", "_").upper()


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes, e.g. "web.listen-address"
    parse: Callable[[str], Any]
    default: str | None  # as the user would type it; None means "unset"
    help: str
    metavar: str = "VALUE"
    #: A switch: ``--name`` / ``--no-name`` on the command line, true/false in the environment.
    boolean: bool = False
    #: The collector this flag configures (set by ``collectors.registry.register`` for the flags a collector
    #: declares), or "": while that collector is disabled the flag has no effect, and the daemon says so at
    #: start. A flag another part also reads (the ledger prices CO2 with ``--carbon.*`` whatever the carbon
    #: collector) is not a collector's.
    collector: str = ""

    @property
    def dest(self) -> str:
        return self.name.replace(".", "_").replace("-", "_")

    @property
    def env(self) -> str:
        return env_of(self.name)
