"""The web config's ``rate_limit``: its setting (``RateLimit``) and the token bucket that applies it.

One bucket per port, shared by every path (health endpoints included, as exporter-toolkit does); a
request that finds it empty gets 429. This module never sleeps and never queues a request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    """``rate_limit``: a token bucket refilled with one request per ``interval_s``, holding ``burst``."""

    interval_s: float
    burst: int


class TokenBucket:
    """``RateLimit`` applied: ``allow()`` takes a token when one is there. Thread-safe."""

    def __init__(self, limit: RateLimit) -> None:
        self._rate = 1.0 / limit.interval_s
        self._burst = float(limit.burst)
        self._tokens = float(limit.burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False
