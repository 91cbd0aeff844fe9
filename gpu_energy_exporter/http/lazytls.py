"""``ssl`` for the HTTP ports, imported with the first TLS connection: ``ssl`` loads OpenSSL's libraries (about
5 MB of the daemon's resident memory) and a port without TLS never needs them.

``TLS.socket`` is ``ssl.SSLSocket`` once loaded (before, a class no socket is an instance of), and
``TLS.would_block`` what a non-blocking send or receive raises when it must wait. ``SSLError`` and its
``Want*`` subclasses are ``OSError``s, so the loop's ``except OSError`` covers them either way. This module
never builds a context (``tls`` does, from the web config).
"""

from __future__ import annotations

import selectors
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl


class _NotTLS:
    """Stands in for ``ssl.SSLSocket`` until a TLS connection is made: no socket is one."""


class TLS:
    socket: type[ssl.SSLSocket] = _NotTLS  # type: ignore[assignment]  # ssl.SSLSocket once loaded
    would_block: tuple[type[BaseException], ...] = (BlockingIOError, InterruptedError)

    @classmethod
    def load(cls) -> None:
        """Import ``ssl``: before the first TLS socket is wrapped."""
        if cls.socket is _NotTLS:
            import ssl

            cls.would_block = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
            cls.socket = ssl.SSLSocket


def handshake(sock: socket.socket) -> int:
    """One step of a non-blocking TLS handshake: 0 when done, else the selector event it waits for.
    Raises ``OSError`` (``ssl.SSLError`` included) when it failed."""
    import ssl  # loaded by now (TLS.load)

    assert isinstance(sock, ssl.SSLSocket)
    try:
        sock.do_handshake()
    except ssl.SSLWantReadError:
        return selectors.EVENT_READ
    except ssl.SSLWantWriteError:
        return selectors.EVENT_WRITE
    return 0
