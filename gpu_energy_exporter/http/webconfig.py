"""The ``--web.config.file``: TLS, basic auth, extra headers and rate limiting for the HTTP endpoints.

The file uses the Prometheus exporter-toolkit format
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md), so a file
written for node_exporter works here unchanged::

    tls_server_config:
      cert_file: server.crt            # relative paths are resolved against this file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    basic_auth_users:
      prometheus: $2y$10$...            # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')
    http_server_config:
      headers:
        X-Content-Type-Options: nosniff
    rate_limit:
      interval: 1s
      burst: 20

``load_web_config(path)`` reads and validates everything at start-up (YAML, keys, certificate and key,
CA, bcrypt hashes) and returns a frozen ``WebConfig`` or raises ``ConfigError`` naming the file, the
key and the problem. Two departures from the Go implementation, both because of what Python's ``ssl``
module can do, and both reported at start-up rather than discovered by a client:

- ``RequestClientCert`` does not ask the client for a certificate (Python cannot request one without
  verifying it; the certificate is never used, so clients see the same behaviour), and
  ``RequireAnyClientCert`` needs ``client_ca_file``/``client_ca`` and then also verifies the certificate.
- ``curve_preferences`` is rejected (Python cannot set a curve list); ``http2`` is accepted and ignored
  (the server speaks HTTP/1.1 only).

Certificates are re-read when their files change (checked with ``stat`` per connection), so a rotated
certificate (cert-manager, Vault) is picked up without a restart, as exporter-toolkit does.

This module never opens sockets and never logs a password or a hash.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import ssl
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import bcrypt
import yaml

from gpu_energy_exporter.core.config import parse_duration
from gpu_energy_exporter.core.errors import ConfigError

log = logging.getLogger(__name__)

CLIENT_AUTH_TYPES: tuple[str, ...] = (
    "NoClientCert",
    "RequestClientCert",
    "RequireAnyClientCert",
    "VerifyClientCertIfGiven",
    "RequireAndVerifyClientCert",
)
# "RequireClientCert" is the old spelling exporter-toolkit still accepts.
_CLIENT_AUTH_ALIASES = {"RequireClientCert": "RequireAnyClientCert", "": "NoClientCert"}

TLS_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

#: Go's ``tls.CipherSuites()`` names (the only ones exporter-toolkit accepts) to OpenSSL names. The
#: TLS 1.3 suites map to None: like Go, they are always enabled and the setting only covers TLS <= 1.2.
CIPHER_SUITES: dict[str, str | None] = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
_CURVES = ("CurveP256", "CurveP384", "CurveP521", "X25519")

#: Headers the file may set, with their allowed values (None: any). Same list as exporter-toolkit, which
#: keeps it closed on purpose so every Prometheus exporter offers the same knobs.
ALLOWED_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}

_TOP_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config", "rate_limit")
_TLS_KEYS = (
    "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
    "client_allowed_sans", "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
    "curve_preferences",
)
_HTTP_KEYS = ("http2", "headers")
_RATE_KEYS = ("interval", "burst")

# $2a$ (Go), $2b$ (OpenBSD, Python) and $2y$ (htpasswd) are the same algorithm for valid UTF-8.
_BCRYPT_RE = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_AUTH_CACHE_MAX = 1024
# Two checks at a time: a guessing flood costs at most two cores' worth of bcrypt, and a new scraper's
# first check usually gets a slot within the short wait below.
_BCRYPT_SLOTS = 2
_BCRYPT_WAIT_S = 0.1


@dataclass(frozen=True)
class TLSServerConfig:
    """``tls_server_config`` with file paths made absolute. Inline PEM (``cert``/``key``/``client_ca``)
    is kept as text; exactly one of each pair is set."""

    cert_file: str | None = None
    key_file: str | None = None
    cert: str | None = field(default=None, repr=False)
    key: str | None = field(default=None, repr=False)
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_ca: str | None = field(default=None, repr=False)
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    @property
    def verify_mode(self) -> ssl.VerifyMode:
        if self.client_auth_type in ("RequireAnyClientCert", "RequireAndVerifyClientCert"):
            return ssl.CERT_REQUIRED
        if self.client_auth_type == "VerifyClientCertIfGiven":
            return ssl.CERT_OPTIONAL
        return ssl.CERT_NONE

    def files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    def build_context(self) -> ssl.SSLContext:
        """A fresh server context. Raises ``ConfigError`` saying which file or setting is at fault."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.minimum_version = TLS_VERSIONS[self.min_version]
            ctx.maximum_version = TLS_VERSIONS[self.max_version]
        except ValueError as exc:
            raise ConfigError(f"tls_server_config: TLS versions not usable with this OpenSSL: {exc}") from None
        self._load_cert_chain(ctx)
        openssl_ciphers = [CIPHER_SUITES[c] for c in self.cipher_suites if CIPHER_SUITES[c]]
        if openssl_ciphers:
            try:
                ctx.set_ciphers(":".join(c for c in openssl_ciphers if c))
            except ssl.SSLError as exc:
                raise ConfigError(f"tls_server_config.cipher_suites: none usable with this OpenSSL ({exc})") from None
        if self.prefer_server_cipher_suites:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.verify_mode = self.verify_mode
        if ctx.verify_mode != ssl.CERT_NONE:
            if self.client_ca_file:
                _check_readable(self.client_ca_file, "client_ca_file")
                try:
                    ctx.load_verify_locations(cafile=self.client_ca_file)
                except ssl.SSLError as exc:
                    raise ConfigError(
                        f"tls_server_config.client_ca_file {self.client_ca_file!r} holds no usable PEM "
                        f"certificate ({exc.reason or exc})"
                    ) from None
            elif self.client_ca:
                try:
                    ctx.load_verify_locations(cadata=self.client_ca)
                except ssl.SSLError as exc:
                    raise ConfigError(
                        f"tls_server_config.client_ca holds no usable PEM certificate ({exc.reason or exc})"
                    ) from None
            else:
                # Go verifies against the system roots when no client CA is given; do the same.
                ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
        # Announce HTTP/1.1 only, so HTTP/2-capable clients do not try h2 on a server that lacks it.
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def _load_cert_chain(self, ctx: ssl.SSLContext) -> None:
        if self.cert_file:
            cert_text = _read_text(self.cert_file, "cert_file")
        else:
            cert_text = self.cert or ""
        if self.key_file:
            key_text = _read_text(self.key_file, "key_file")
        else:
            key_text = self.key or ""
        cert_name = f"cert_file {self.cert_file!r}" if self.cert_file else "cert"
        key_name = f"key_file {self.key_file!r}" if self.key_file else "key"
        if "-----BEGIN CERTIFICATE-----" not in cert_text:
            raise ConfigError(f"tls_server_config.{cert_name} holds no PEM certificate")
        if not re.search(r"-----BEGIN [A-Z ]*PRIVATE KEY-----", key_text):
            raise ConfigError(f"tls_server_config.{key_name} holds no PEM private key")
        if "ENCRYPTED" in key_text:
            raise ConfigError(f"tls_server_config.{key_name} is encrypted; give an unencrypted key")

        def no_password() -> bytes:
            raise ConfigError(f"tls_server_config.{key_name} is encrypted; give an unencrypted key")

        # load_cert_chain only takes paths: inline PEM goes through a private temporary directory.
        with tempfile.TemporaryDirectory(prefix="gpuenergy-tls-") as tmp:
            cert_path = self.cert_file or _write_private(tmp, "cert.pem", cert_text)
            key_path = self.key_file or _write_private(tmp, "key.pem", key_text)
            try:
                ctx.load_cert_chain(cert_path, key_path, password=no_password)
            except ssl.SSLError as exc:
                raise ConfigError(
                    f"tls_server_config: {cert_name} and {key_name} cannot be used together: the key "
                    f"does not match the certificate or a PEM block is damaged (OpenSSL: {exc.reason or exc})"
                ) from None
            except OSError as exc:
                raise ConfigError(f"tls_server_config: cannot load {cert_name} / {key_name}: {exc}") from None

    def client_san_allowed(self, peercert: Mapping[str, Any] | None) -> bool:
        """True when no ``client_allowed_sans`` are set, or the verified client certificate
        (``SSLSocket.getpeercert()``) has one of them as a DNS, IP, e-mail or URI SAN."""
        if not self.client_allowed_sans:
            return True
        if not peercert:
            return False
        allowed = {_normalise_san(s) for s in self.client_allowed_sans}
        for kind, value in peercert.get("subjectAltName", ()):
            if kind in ("DNS", "IP Address", "email", "URI") and _normalise_san(value) in allowed:
                return True
        return False


@dataclass(frozen=True)
class RateLimit:
    """``rate_limit``: a token bucket refilled with one request per ``interval_s``, holding ``burst``."""

    interval_s: float
    burst: int


@dataclass(frozen=True, eq=False)
class WebConfig:
    """A validated web configuration. ``WebConfig()`` is plain HTTP without authentication.

    Thread-safe: the server calls ``ssl_context()`` and ``check_basic_auth()`` from many threads.
    """

    source: str | None = None
    tls: TLSServerConfig | None = None
    basic_auth_users: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    headers: tuple[tuple[str, str], ...] = ()
    rate_limit: RateLimit | None = None
    _state: _State = field(default_factory=lambda: _State(), repr=False)

    @property
    def tls_enabled(self) -> bool:
        return self.tls is not None

    @property
    def auth_enabled(self) -> bool:
        return bool(self.basic_auth_users)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server context, or None without TLS. Rebuilt when a certificate, key or CA file changes;
        if the new files do not load, the last good context stays in use and the error is logged."""
        if self.tls is None:
            return None
        st = self._state
        signature = _file_signature(self.tls.files())
        with st.lock:
            if st.context is not None and signature == st.signature:
                return st.context
            try:
                ctx = self.tls.build_context()
            except ConfigError as exc:
                if st.context is None:
                    raise
                if signature != st.failed_signature:
                    log.error("TLS files changed but cannot be loaded, still using the previous ones: %s", exc)
                    st.failed_signature = signature
                return st.context
            if st.context is not None:
                log.info("TLS certificate files changed: reloaded")
            st.context, st.signature, st.failed_signature = ctx, signature, None
            return ctx

    def cached_basic_auth(self, authorization: str | None) -> bool | None:
        """The answer ``check_basic_auth`` would give when it needs no bcrypt check (no users, a malformed
        header, cached credentials), else None. Cheap: the server uses it to keep checks that need bcrypt
        apart from everything else."""
        if not self.basic_auth_users:
            return True
        creds = parse_basic_authorization(authorization)
        if creds is None:
            return False
        with self._state.lock:
            return self._state.auth_cache.get(self._cache_key(*creds))

    def _cache_key(self, user: str, password: bytes) -> bytes:
        u = user.encode()
        return hmac.new(self._state.secret, b"%d:%s%s" % (len(u), u, password), hashlib.sha256).digest()

    def check_basic_auth(self, authorization: str | None) -> bool:
        """True when no users are configured, or ``authorization`` (the raw ``Authorization`` header)
        carries the right password for a configured user.

        Results, good and bad, are cached under an HMAC of (user, password) with a per-process key (as
        exporter-toolkit does), so a scraper pays the bcrypt cost once, a client repeating a wrong password
        pays it once, and no plaintext is kept; the cache is bounded (least recently used goes first).
        At most ``_BCRYPT_SLOTS`` bcrypt checks run at a time; a check that finds them all busy waits
        ``_BCRYPT_WAIT_S`` at most, then raises ``AuthBusy`` (the server answers 429), so a flood of
        guesses can neither queue threads nor delay a scraper whose credentials are cached. An unknown
        user is checked against a dummy hash of the same cost, so timing does not reveal which user names
        exist.
        """
        if not self.basic_auth_users:
            return True
        creds = parse_basic_authorization(authorization)
        if creds is None:
            return False
        user, password = creds
        st = self._state
        hashed = self.basic_auth_users.get(user)
        key = self._cache_key(user, password)
        with st.lock:
            cached = st.auth_cache.get(key)
            if cached is not None:
                st.auth_cache.move_to_end(key)
                return cached
        if not st.bcrypt_slots.acquire(timeout=_BCRYPT_WAIT_S):
            raise AuthBusy("too many password checks in progress")
        try:
            target = hashed if hashed is not None else self._dummy_hash()
            try:
                ok = bcrypt.checkpw(password, target.encode("ascii"))
            except ValueError:  # bcrypt >= 5 refuses passwords over 72 bytes
                ok = False
        finally:
            st.bcrypt_slots.release()
        ok = ok and hashed is not None
        with st.lock:
            st.auth_cache[key] = ok
            while len(st.auth_cache) > _AUTH_CACHE_MAX:
                st.auth_cache.popitem(last=False)
        return ok

    def _dummy_hash(self) -> str:
        st = self._state
        with st.lock:
            if st.dummy_hash is None:
                cost = max(int(_BCRYPT_RE.match(h).group(1)) for h in self.basic_auth_users.values())  # type: ignore[union-attr]
                st.dummy_hash = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds=cost)).decode()
            return st.dummy_hash


class AuthBusy(Exception):
    """Every bcrypt slot stayed busy: answer 429 rather than queue the check."""


class _State:
    """Mutable caches behind a frozen WebConfig."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bcrypt_slots = threading.BoundedSemaphore(_BCRYPT_SLOTS)
        self.context: ssl.SSLContext | None = None
        self.signature: tuple[Any, ...] | None = None
        self.failed_signature: tuple[Any, ...] | None = None
        self.secret = secrets.token_bytes(32)
        self.auth_cache: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self.dummy_hash: str | None = None


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


# ----------------------------------------------------------------------------------------------------
# loading


def load_web_config(path: str | os.PathLike[str] | None) -> WebConfig:
    """Read and validate a web config file; None gives plain HTTP without authentication."""
    if path is None or str(path) == "":
        return WebConfig()
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read web config file {path!r}: {reason}") from None
    return parse_web_config(text, base_dir=os.path.dirname(os.path.abspath(path)), source=path)


def parse_web_config(text: str, *, base_dir: str, source: str = "<web config>") -> WebConfig:
    """Validate web config YAML ``text``; relative paths resolve against ``base_dir``."""
    try:
        return _parse(text, base_dir, source)
    except ConfigError as exc:
        raise ConfigError(f"web config file {source!r}: {exc}") from None


def _parse(text: str, base_dir: str, source: str) -> WebConfig:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from None
    if doc is None:
        doc = {}
    top = _mapping(doc, "the top level")
    _known_keys(top, _TOP_KEYS, "the top level")
    tls = _parse_tls(top.get("tls_server_config"), base_dir)
    users = _parse_users(top.get("basic_auth_users"))
    headers = _parse_http(top.get("http_server_config"))
    rate = _parse_rate_limit(top.get("rate_limit"))
    cfg = WebConfig(source=source, tls=tls, basic_auth_users=users, headers=headers, rate_limit=rate)
    cfg.ssl_context()  # load certificates now: a bad file fails start-up, not the first scrape
    return cfg


def _parse_tls(raw: Any, base_dir: str) -> TLSServerConfig | None:
    section = "tls_server_config"
    if raw is None:
        return None
    m = _mapping(raw, section)
    _known_keys(m, _TLS_KEYS, section)
    s = {k: _string(m, k, section) for k in (
        "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
        "min_version", "max_version")}
    if all(v is None or v == "" or v == [] for v in m.values()):
        return None  # an empty section means plain HTTP, as in exporter-toolkit
    for a, b in (("cert", "cert_file"), ("key", "key_file"), ("client_ca", "client_ca_file")):
        if s[a] and s[b]:
            raise ConfigError(f"{section}: give either {a} or {b}, not both")
    if not (s["cert"] or s["cert_file"]):
        raise ConfigError(f"{section}: missing one of cert or cert_file")
    if not (s["key"] or s["key_file"]):
        raise ConfigError(f"{section}: missing one of key or key_file")

    auth = s["client_auth_type"] or ""
    auth = _CLIENT_AUTH_ALIASES.get(auth, auth)
    if auth not in CLIENT_AUTH_TYPES:
        raise ConfigError(f"{section}.client_auth_type {auth!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    has_ca = bool(s["client_ca"] or s["client_ca_file"])
    if has_ca and auth == "NoClientCert":
        raise ConfigError(f"{section}: client_ca_file is set but client_auth_type is NoClientCert; "
                          "set client_auth_type: RequireAndVerifyClientCert to check client certificates")
    if auth == "RequireAnyClientCert":
        if not has_ca:
            raise ConfigError(
                f"{section}.client_auth_type RequireAnyClientCert: Python's ssl module cannot accept a "
                "client certificate without verifying it; set client_ca_file (certificates will then be "
                "verified against it) or use RequireAndVerifyClientCert")
        log.warning("%s.client_auth_type RequireAnyClientCert: client certificates are also verified "
                    "against client_ca_file (Python's ssl cannot skip verification)", section)
    if auth == "RequestClientCert":
        log.info("%s.client_auth_type RequestClientCert: no client certificate is requested (it would "
                 "never be used)", section)

    sans = tuple(_string_list(m, "client_allowed_sans", section))
    if "client_allowed_sans" in m and auth not in ("RequireAnyClientCert", "RequireAndVerifyClientCert"):
        raise ConfigError(f"{section}: client_allowed_sans requires client_auth_type RequireAnyClientCert "
                          "or RequireAndVerifyClientCert")

    versions = {}
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = s[key] or default
        if v not in TLS_VERSIONS:
            raise ConfigError(f"{section}.{key} {v!r} is not one of {', '.join(TLS_VERSIONS)}")
        versions[key] = v
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise ConfigError(f"{section}: min_version {versions['min_version']} is above max_version "
                          f"{versions['max_version']}")

    ciphers = tuple(_string_list(m, "cipher_suites", section))
    for c in ciphers:
        if c not in CIPHER_SUITES:
            raise ConfigError(f"{section}.cipher_suites: unknown or insecure cipher {c!r}; accepted: "
                              + ", ".join(CIPHER_SUITES))
    curves = _string_list(m, "curve_preferences", section)
    for c in curves:
        if c not in _CURVES:
            raise ConfigError(f"{section}.curve_preferences: unknown curve {c!r}; accepted: {', '.join(_CURVES)}")
    if curves:
        raise ConfigError(f"{section}.curve_preferences is not supported by this exporter (Python's ssl "
                          "module cannot set a curve list); remove it to use OpenSSL's defaults")
    prefer = m.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(f"{section}.prefer_server_cipher_suites must be true or false")

    def path(key: str) -> str | None:
        p = s[key]
        return os.path.normpath(os.path.join(base_dir, p)) if p else None

    return TLSServerConfig(
        cert_file=path("cert_file"), key_file=path("key_file"), cert=s["cert"], key=s["key"],
        client_auth_type=auth, client_ca_file=path("client_ca_file"), client_ca=s["client_ca"],
        client_allowed_sans=sans, min_version=versions["min_version"], max_version=versions["max_version"],
        cipher_suites=ciphers, prefer_server_cipher_suites=prefer,
    )


def _parse_users(raw: Any) -> Mapping[str, str]:
    section = "basic_auth_users"
    if raw is None:
        return MappingProxyType({})
    m = _mapping(raw, section)
    users: dict[str, str] = {}
    for user, hashed in m.items():
        if not isinstance(user, str) or not user:
            raise ConfigError(f"{section}: user name {user!r} must be a non-empty string (quote it)")
        if ":" in user:
            raise ConfigError(f"{section}: user name {user!r} contains ':', which basic auth cannot carry")
        match = _BCRYPT_RE.match(hashed) if isinstance(hashed, str) else None
        if match is None or not 4 <= int(match.group(1)) <= 31:
            raise ConfigError(
                f"{section}: the password of user {user!r} is not a bcrypt hash (expected something like "
                "$2y$10$ followed by 53 characters, as printed by: htpasswd -nBC 10 \"\" | tr -d ':\\n')")
        users[user] = hashed
    return MappingProxyType(users)


def _parse_http(raw: Any) -> tuple[tuple[str, str], ...]:
    section = "http_server_config"
    if raw is None:
        return ()
    m = _mapping(raw, section)
    _known_keys(m, _HTTP_KEYS, section)
    if "http2" in m and not isinstance(m["http2"], bool):
        raise ConfigError(f"{section}.http2 must be true or false")
    raw_headers = m.get("headers")
    if raw_headers is None:
        return ()
    hm = _mapping(raw_headers, f"{section}.headers")
    headers: list[tuple[str, str]] = []
    for name, value in hm.items():
        if name not in ALLOWED_HEADERS:
            raise ConfigError(f"{section}.headers: header {name!r} can not be configured; allowed: "
                              + ", ".join(ALLOWED_HEADERS))
        if value is None or value == "":
            continue  # "unset if blank"
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise ConfigError(f"{section}.headers.{name} must be a single-line string")
        allowed = ALLOWED_HEADERS[name]
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{section}.headers.{name}: {value!r} is not one of {', '.join(allowed)}")
        headers.append((name, value))
    return tuple(headers)


def _parse_rate_limit(raw: Any) -> RateLimit | None:
    section = "rate_limit"
    if raw is None:
        return None
    m = _mapping(raw, section)
    _known_keys(m, _RATE_KEYS, section)
    interval_raw = m.get("interval", 0)
    try:
        interval = parse_duration(str(interval_raw))
    except ValueError as exc:
        raise ConfigError(f"{section}.interval {interval_raw!r} {exc}") from None
    if interval == 0:
        return None
    burst = m.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 1:
        raise ConfigError(f"{section}.burst must be a positive integer when interval is set, got {burst!r}")
    return RateLimit(interval, burst)


# ----------------------------------------------------------------------------------------------------
# helpers


def _mapping(value: Any, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(value).__name__}")
    return value


def _known_keys(m: Mapping[Any, Any], known: tuple[str, ...], where: str) -> None:
    for key in m:
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in {where} (known keys: {', '.join(known)})")


def _string(m: Mapping[str, Any], key: str, section: str) -> str | None:
    value = m.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{section}.{key} must be a string, got {type(value).__name__}")
    return value


def _string_list(m: Mapping[str, Any], key: str, section: str) -> list[str]:
    value = m.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{section}.{key} must be a list of strings")
    return value


def _check_readable(path: str, key: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"tls_server_config.{key} {path!r}: cannot read: {exc.strerror or exc}") from None


def _read_text(path: str, key: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"tls_server_config.{key} {path!r}: cannot read: {exc.strerror or exc}") from None


def _write_private(directory: str, name: str, text: str) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii", errors="replace") as fh:
        fh.write(text)
    return path


def _file_signature(paths: tuple[str, ...]) -> tuple[Any, ...]:
    sig: list[Any] = []
    for p in paths:
        try:
            st = os.stat(p)
            sig.append((p, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            sig.append((p, None))
    return tuple(sig)


def _normalise_san(value: str) -> str:
    # Python prints IPv6 SANs uncompressed and upper-case; Go compressed and lower-case.
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        return value.strip()
