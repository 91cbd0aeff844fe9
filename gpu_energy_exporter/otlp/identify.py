"""Who pushed a request: the bearer tokens and their tenants (``--otlp.bearer-token-file``), the kernel's view of
the connection (``http.peers``) and the trusted forwarders (``--otlp.trusted-forwarders``), giving the
``core.clientid.Peer`` every point of the request is stored under (docs/security.md).

The order: the transport establishes the peer (the socket table or ``SO_PEERCRED`` on the node, else the
address); a per-tenant token makes the tenant the identity, whatever the path; a listed forwarder vouches for
its clients' claims. Tokens are compared by their SHA-256 digest: the time a look-up takes says nothing of how
much of a token was right. This module never reads a request body and never touches the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_energy_exporter.core.clientid import UNRESOLVED_LOCAL, Peer, address_peer, forwarder_matches
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.http.messages import Request
from gpu_energy_exporter.http.peers import PeerResolver


def load_bearer_token(path: str) -> str:
    """The token from ``--otlp.bearer-token-file`` (surrounding whitespace removed)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --otlp.bearer-token-file {path!r}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"--otlp.bearer-token-file {path!r} is empty; put the token in it")
    return token


_TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def load_bearer_tokens(path: str) -> dict[str, str]:
    """``--otlp.bearer-token-file``: token -> tenant. The file holds one token (the whole file: any pusher
    holding it, tenant ""), as before, or one ``<tenant> <token>`` per line (``#`` comments, blank lines
    skipped): per-tenant tokens, each push's identity then being its token's tenant (docs/security.md).
    ``ConfigError`` naming the line that is wrong."""
    token = load_bearer_token(path)
    lines = [line.strip() for line in token.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if len(lines) == 1 and len(lines[0].split()) == 1:
        return {lines[0]: ""}
    out: dict[str, str] = {}
    for n, line in enumerate(token.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"--otlp.bearer-token-file {path!r} line {n}: want '<tenant> <token>' (one token per "
                              "tenant), or a file holding a single token")
        tenant, secret = parts
        if not set(tenant) <= _TENANT_CHARS or len(tenant) > 64:
            raise ConfigError(f"--otlp.bearer-token-file {path!r} line {n}: tenant name {tenant[:70]!r} may use "
                              "letters, digits, '.', '_' and '-' only (64 at most)")
        if secret in out:
            raise ConfigError(f"--otlp.bearer-token-file {path!r} line {n}: the token of {tenant!r} is also "
                              f"{out[secret]!r}'s; every tenant needs a token of its own")
        out[secret] = tenant
    if not out:
        raise ConfigError(f"--otlp.bearer-token-file {path!r} has no token; put the token in it")
    return out


class Identities:
    """Tokens (token -> tenant, "" for one every pusher shares), the kernel's view of a connection
    (``resolver``; None: peers are known by address only) and the trusted forwarders. Thread-safe."""

    def __init__(self, *, tokens: Mapping[str, str] | None = None, bearer_token: str | None = None,
                 resolver: PeerResolver | None = None, forwarders: tuple[str, ...] = ()) -> None:
        table = dict(tokens or {})
        if bearer_token:
            table.setdefault(bearer_token, "")
        self._tokens: dict[bytes, str] | None = None
        if table:
            import hashlib  # here: it loads OpenSSL's libcrypto (~4 MB), and only a configured token needs it

            self._tokens = {hashlib.sha256(t.encode()).digest(): tenant for t, tenant in table.items()}
        self.tenants = sorted({t for t in table.values() if t})
        self.resolver = resolver
        self.forwarders = forwarders

    @property
    def bearer_required(self) -> bool:
        return self._tokens is not None

    def authenticate(self, authorization: str) -> str | None:
        """The tenant an ``Authorization`` value (HTTP header or gRPC metadata) carries a token of ("" for the
        shared token, or when none is required); None when it carries none of the tokens."""
        if self._tokens is None:
            return ""
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        import hashlib

        return self._tokens.get(hashlib.sha256(credentials.strip().encode()).digest())

    def identify(self, peer: Peer, authorization: str) -> Peer:
        """The identity of a push from ``peer`` (what the transport established) carrying ``authorization``:
        its tenant when it carries a per-tenant token, trusted to vouch for its clients when it is a listed
        forwarder (``core.clientid``)."""
        tenant = self.authenticate(authorization)
        if tenant:
            peer = peer.with_tenant(tenant)
        if self.forwarders and forwarder_matches(peer, self.forwarders):
            peer = peer.trusted()
        return peer

    def unix_peer(self, info: Any) -> Peer:
        """The peer of a Unix-socket connection (its ``http.connection.ConnectionInfo``): ``SO_PEERCRED``."""
        return self.resolver.unix(info.credentials) if self.resolver is not None else UNRESOLVED_LOCAL

    def tcp_peer(self, address: str, port: int, local_port: int) -> Peer:
        """What the kernel says of a TCP peer (``http.peers``), or its address without a resolver."""
        if self.resolver is None:
            return address_peer(address)
        return self.resolver.tcp(address, port, local_port)

    def connection_peer(self, req: Request) -> Peer:
        """The peer of the request's connection, established at its first request and kept on the connection
        (``ConnectionInfo.identity``) for the next ones."""
        info = req.connection
        if info is None:
            return address_peer(str(req.client_address[0]) if req.client_address else "")
        known = info.identity
        if isinstance(known, Peer):
            return known
        if info.unix:
            peer = self.unix_peer(info)
        elif len(info.peer) >= 2 and len(info.local) >= 2:
            peer = self.tcp_peer(str(info.peer[0]), int(info.peer[1]), int(info.local[1]))
        else:
            peer = address_peer(str(info.peer[0]) if info.peer else "")
        info.identity = peer
        return peer
