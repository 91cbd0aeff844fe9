"""The one size-limited decompressor for request bodies (gzip, zlib and raw deflate).

``inflate(data, limit, wbits)`` never produces more than ``limit`` bytes, whatever the input claims: the
output is requested ``limit + 1`` bytes at a time at most, so a gzip bomb costs at most ``limit`` bytes of
memory. gzip bodies may hold several members (RFC 1952 2.2); zlib and raw deflate streams are one stream,
and bytes after its end are ignored.

Pure: bytes in, bytes or an exception out. It knows no HTTP status and no flag; each caller turns the
three exceptions into its own answer (``messages.decode_body`` for the server's handlers, the OTLP
receiver for its ``google.rpc.Status`` bodies). It never logs.
"""

from __future__ import annotations

import zlib

#: ``wbits`` for each framing zlib knows.
GZIP = 16 + zlib.MAX_WBITS
ZLIB = zlib.MAX_WBITS
RAW_DEFLATE = -zlib.MAX_WBITS


class MalformedBody(ValueError):
    """The data is not a valid stream of its kind; the message is zlib's reason."""


class TruncatedBody(ValueError):
    """A stream ended before its end marker."""


class BodyTooLarge(ValueError):
    """The decompressed data would exceed ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"decompressed data exceeds {limit} bytes")
        self.limit = limit


def inflate(data: bytes, limit: int, wbits: int = GZIP) -> bytes:
    """Decompress every member of ``data`` (``wbits``: ``GZIP``, ``ZLIB`` or ``RAW_DEFLATE``), never
    producing more than ``limit`` bytes. Raises ``MalformedBody``, ``TruncatedBody`` or ``BodyTooLarge``.

    The output is kept as zlib's own pieces and joined once (a single piece, the usual case, is returned as
    it is): growing one buffer and copying it out held the body three times at the end."""
    pieces: list[bytes] = []
    size = 0
    rest = data
    while rest:
        d = zlib.decompressobj(wbits)
        buf = rest
        while True:
            try:
                chunk = d.decompress(buf, limit + 1 - size)
            except zlib.error as exc:
                raise MalformedBody(str(exc)) from None
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            if chunk:
                pieces.append(chunk)
            buf = d.unconsumed_tail
            if d.eof or (not chunk and not buf):
                break
        if not d.eof:
            raise TruncatedBody("compressed body is truncated")
        rest = d.unused_data
        if wbits != GZIP:  # zlib streams have no multi-member form
            break
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
