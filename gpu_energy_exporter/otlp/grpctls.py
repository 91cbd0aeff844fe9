"""TLS for the OTLP/gRPC receiver: ``--web.config.file``'s ``tls_server_config`` as grpcio server credentials.

``check_tls`` refuses at start-up what grpcio cannot enforce (``client_allowed_sans``, TLS versions other than
1.2 to 1.3, ``cipher_suites``) rather than serve weaker than the file says, and loads the files once through
``ssl`` for the metrics port's messages. ``TLSCredentials`` builds the credentials and re-reads the files
when they change (grpcio asks on each new connection). Never opens a socket; ``grpc`` is imported only when
credentials are built.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.http.tls import TLSServerConfig

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)


def check_tls(tls: TLSServerConfig) -> None:
    """``ConfigError`` for what the gRPC port cannot enforce, and for files ``ssl`` cannot load."""
    where = "--web.config.file tls_server_config"
    off = "or turn the OTLP/gRPC receiver off with --otlp.grpc.listen-address=''"
    if tls.client_allowed_sans:
        raise ConfigError(f"{where}: client_allowed_sans cannot be checked on the OTLP/gRPC port (grpcio has "
                          f"no such check); remove it {off}")
    if tls.min_version not in ("TLS12", "TLS10", "TLS11") or tls.max_version != "TLS13":
        raise ConfigError(f"{where}: the OTLP/gRPC port serves TLS 1.2 and 1.3 and cannot be limited to "
                          f"{tls.min_version}..{tls.max_version}; remove min_version/max_version {off}")
    if tls.cipher_suites:
        raise ConfigError(f"{where}: cipher_suites cannot be chosen on the OTLP/gRPC port (grpcio uses its "
                          f"own list of modern suites); remove it {off}")
    tls.build_context()  # the same checks and messages as the metrics port


class TLSCredentials:
    """``tls_server_config`` as gRPC server credentials, re-read when its files change (checked by gRPC on
    each new connection)."""

    def __init__(self, tls: TLSServerConfig) -> None:
        self.tls = tls
        self._stamp = self._files_stamp()

    def _files_stamp(self) -> tuple[tuple[str, float, int], ...]:
        out = []
        for path in self.tls.files():
            try:
                st = os.stat(path)
                out.append((path, st.st_mtime, st.st_size))
            except OSError:
                out.append((path, 0.0, -1))
        return tuple(out)

    @staticmethod
    def _read(inline: str | None, path: str | None) -> bytes | None:
        if inline:
            return inline.encode()
        if path:
            with open(path, "rb") as f:
                return f.read()
        return None

    def _configuration(self) -> Any:
        import grpc

        tls = self.tls
        key, cert = self._read(tls.key, tls.key_file), self._read(tls.cert, tls.cert_file)
        assert key is not None and cert is not None
        ca = self._read(tls.client_ca, tls.client_ca_file) if self._require_client() else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _require_client(self) -> bool:
        # VerifyClientCertIfGiven: grpcio cannot ask for an optional certificate; such clients are served as
        # with NoClientCert (which that setting lets in anyway).
        return self.tls.client_auth_type in ("RequireAnyClientCert", "RequireAndVerifyClientCert")

    def _fetch(self) -> Any:
        stamp = self._files_stamp()
        if stamp == self._stamp:
            return None
        try:
            self.tls.build_context()
            configuration = self._configuration()
        except (ConfigError, OSError) as exc:
            log.warning("OTLP/gRPC: keeping the previous TLS certificate: %s", exc)
            return None
        self._stamp = stamp
        log.info("OTLP/gRPC: TLS certificate files changed, reloaded")
        return configuration

    def credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=self._require_client())
