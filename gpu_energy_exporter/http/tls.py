"""The web config's ``tls_server_config`` applied: a server ``ssl.SSLContext`` built from it, rebuilt when
its certificate, key or CA files change, and the ``client_allowed_sans`` check.

Certificates are re-read when their files change (checked with ``stat`` per connection), so a rotated
certificate (cert-manager, Vault) is picked up without a restart, as exporter-toolkit does; if the new files
do not load, the last good context stays in use. Two departures from the Go implementation, both because
of what Python's ``ssl`` module can do, are checked when the file is loaded (``webconfig``).

This module never opens a socket and never logs key material.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_energy_exporter.core.errors import ConfigError

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)

CLIENT_AUTH_TYPES: tuple[str, ...] = (
    "NoClientCert",
    "RequestClientCert",
    "RequireAnyClientCert",
    "VerifyClientCertIfGiven",
    "RequireAndVerifyClientCert",
)

#: exporter-toolkit's version names to the protocol numbers ``ssl.TLSVersion`` has for them (numbers, so that
#: reading a web config does not import ``ssl``: OpenSSL's libraries, about 5 MB, only TLS needs them)
TLS_VERSIONS: dict[str, int] = {"TLS10": 0x0301, "TLS11": 0x0302, "TLS12": 0x0303, "TLS13": 0x0304}

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
#: The curve names exporter-toolkit accepts (the loader refuses them all: Python cannot set a curve list).
CURVES = ("CurveP256", "CurveP384", "CurveP521", "X25519")


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
        import ssl

        if self.client_auth_type in ("RequireAnyClientCert", "RequireAndVerifyClientCert"):
            return ssl.CERT_REQUIRED
        if self.client_auth_type == "VerifyClientCertIfGiven":
            return ssl.CERT_OPTIONAL
        return ssl.CERT_NONE

    def files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    def build_context(self) -> ssl.SSLContext:
        """A fresh server context. Raises ``ConfigError`` saying which file or setting is at fault."""
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.minimum_version = ssl.TLSVersion(TLS_VERSIONS[self.min_version])
            ctx.maximum_version = ssl.TLSVersion(TLS_VERSIONS[self.max_version])
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
        import ssl
        import tempfile

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



class ContextReloader:
    """The last good server context of a ``TLSServerConfig``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: ssl.SSLContext | None = None
        self._signature: tuple[Any, ...] | None = None
        self._failed_signature: tuple[Any, ...] | None = None

    def context(self, tls: TLSServerConfig) -> ssl.SSLContext:
        """The context for ``tls``, rebuilt when a certificate, key or CA file changes; if the new files do
        not load, the last good context stays in use and the error is logged (raised when there is none)."""
        signature = _file_signature(tls.files())
        with self._lock:
            if self._context is not None and signature == self._signature:
                return self._context
            try:
                ctx = tls.build_context()
            except ConfigError as exc:
                if self._context is None:
                    raise
                if signature != self._failed_signature:
                    log.error("TLS files changed but cannot be loaded, still using the previous ones: %s", exc)
                    self._failed_signature = signature
                return self._context
            if self._context is not None:
                log.info("TLS certificate files changed: reloaded")
            self._context, self._signature, self._failed_signature = ctx, signature, None
            return ctx


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
