"""The web config's ``basic_auth_users`` applied: checking an ``Authorization`` header against bcrypt
hashes, with a bounded cache and a bounded number of bcrypt checks at a time.

Results, good and bad, are cached under an HMAC of (user, password) with a per-process key (as
exporter-toolkit does), so a scraper pays the bcrypt cost once, a client repeating a wrong password pays it
once, and no plaintext is kept; the cache is bounded (least recently used goes first). At most
``_BCRYPT_SLOTS`` bcrypt checks run at a time; a check that finds them all busy waits ``_BCRYPT_WAIT_S`` at
most, then raises ``AuthBusy`` (the server answers 429), so a flood of guesses can neither queue threads
nor delay a scraper whose credentials are cached. An unknown user is checked against a dummy hash of the
same cost, so timing does not reveal which user names exist.

This module never logs a password or a hash and never keeps a password in memory past the check.
"""

from __future__ import annotations

import base64
import binascii
import collections
import os
import re
import threading
from collections.abc import Mapping

# $2a$ (Go), $2b$ (OpenBSD, Python) and $2y$ (htpasswd) are the same algorithm for valid UTF-8.
BCRYPT_RE = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
#: Credentials whose result is remembered (docs/configuration.md quotes it).
AUTH_CACHE_MAX = 1024
# Two checks at a time: a guessing flood costs at most two cores' worth of bcrypt, and a new scraper's
# first check usually gets a slot within the short wait below.
_BCRYPT_SLOTS = 2
_BCRYPT_WAIT_S = 0.1


class AuthBusy(Exception):
    """Every bcrypt slot stayed busy: answer 429 rather than queue the check."""


def parse_basic_authorization(header: str | None) -> tuple[str, bytes] | None:
    """``Basic base64(user:password)`` to (user, password bytes), or None when malformed."""
    if not header:
        return None
    scheme, _, param = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(param.strip(), validate=True)
        user_bytes, sep, password = raw.partition(b":")
        if not sep:
            return None
        return user_bytes.decode("utf-8"), password
    except (binascii.Error, UnicodeDecodeError):
        return None


class BasicAuth:
    """Checks against ``users`` (user name to bcrypt hash, validated by the loader). Thread-safe."""

    def __init__(self, users: Mapping[str, str]) -> None:
        self._users = users
        self._lock = threading.Lock()
        self._bcrypt_slots = threading.BoundedSemaphore(_BCRYPT_SLOTS)
        self._secret = os.urandom(32)
        self._cache: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._dummy: str | None = None

    def cached(self, authorization: str | None) -> bool | None:
        """The answer ``check`` would give when it needs no bcrypt check (no users, a malformed header,
        cached credentials), else None. Cheap: the server uses it to keep checks that need bcrypt apart
        from everything else."""
        if not self._users:
            return True
        creds = parse_basic_authorization(authorization)
        if creds is None:
            return False
        with self._lock:
            return self._cache.get(self._cache_key(*creds))

    def _cache_key(self, user: str, password: bytes) -> bytes:
        u = user.encode()
        import hashlib  # here: hashlib loads OpenSSL's libcrypto (~4 MB), and only basic auth needs it
        import hmac

        return hmac.new(self._secret, b"%d:%s%s" % (len(u), u, password), hashlib.sha256).digest()

    def check(self, authorization: str | None) -> bool:
        """True when no users are configured, or ``authorization`` (the raw ``Authorization`` header)
        carries the right password for a configured user. Raises ``AuthBusy`` (see the module docstring)."""
        if not self._users:
            return True
        creds = parse_basic_authorization(authorization)
        if creds is None:
            return False
        user, password = creds
        hashed = self._users.get(user)
        key = self._cache_key(user, password)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        import bcrypt  # only where basic auth is configured: the daemon without it never loads it

        if not self._bcrypt_slots.acquire(timeout=_BCRYPT_WAIT_S):
            raise AuthBusy("too many password checks in progress")
        try:
            target = hashed if hashed is not None else self._dummy_hash()
            try:
                ok = bcrypt.checkpw(password, target.encode("ascii"))
            except ValueError:  # bcrypt >= 5 refuses passwords over 72 bytes
                ok = False
        finally:
            self._bcrypt_slots.release()
        ok = ok and hashed is not None
        with self._lock:
            self._cache[key] = ok
            while len(self._cache) > AUTH_CACHE_MAX:
                self._cache.popitem(last=False)
        return ok

    def _dummy_hash(self) -> str:
        with self._lock:
            if self._dummy is None:
                import bcrypt

                cost = max(int(BCRYPT_RE.match(h).group(1)) for h in self._users.values())  # type: ignore[union-attr]
                self._dummy = bcrypt.hashpw(os.urandom(16), bcrypt.gensalt(rounds=cost)).decode()
            return self._dummy
