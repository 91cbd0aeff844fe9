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

This module turns the file into a frozen ``WebConfig``; applying it is for ``tls`` (the server context,
reloaded when certificate files change), ``basicauth`` (bcrypt checks and their cache) and ``ratelimit``
(the token bucket). It never opens sockets and never logs a password or a hash.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.flagtypes import parse_duration
from gpu_energy_exporter.http.basicauth import BCRYPT_RE, BasicAuth
from gpu_energy_exporter.http.ratelimit import RateLimit
from gpu_energy_exporter.http.tls import (
    CIPHER_SUITES,
    CLIENT_AUTH_TYPES,
    CURVES,
    TLS_VERSIONS,
    ContextReloader,
    TLSServerConfig,
)

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)

# "RequireClientCert" is the old spelling exporter-toolkit still accepts.
_CLIENT_AUTH_ALIASES = {"RequireClientCert": "RequireAnyClientCert", "": "NoClientCert"}

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
    _contexts: ContextReloader = field(default_factory=ContextReloader, repr=False)
    _auth: BasicAuth = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_auth", BasicAuth(self.basic_auth_users))

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
        return self._contexts.context(self.tls)

    def cached_basic_auth(self, authorization: str | None) -> bool | None:
        """``check_basic_auth``'s answer when it needs no bcrypt check, else None (``BasicAuth.cached``)."""
        return self._auth.cached(authorization)

    def check_basic_auth(self, authorization: str | None) -> bool:
        """True when no users are configured, or ``authorization`` (the raw ``Authorization`` header)
        carries the right password for a configured user (``BasicAuth.check``: cached, bounded, may raise
        ``AuthBusy``)."""
        return self._auth.check(authorization)


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
    import yaml  # only with --web.config.file: the daemon without one never loads it

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
        if c not in CURVES:
            raise ConfigError(f"{section}.curve_preferences: unknown curve {c!r}; accepted: {', '.join(CURVES)}")
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
        match = BCRYPT_RE.match(hashed) if isinstance(hashed, str) else None
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
