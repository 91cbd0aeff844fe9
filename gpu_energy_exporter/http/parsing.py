"""HTTP/1.x request framing, strictly: the request line, header fields, the body's framing and chunked
bodies, from the bytes a connection has received so far.

Strict on purpose (RFC 9112): ``HTTP/1.0`` and ``HTTP/1.1`` only (HTTP/0.9 gets 400, others 505), one
``Content-Length`` of ASCII digits, ``Transfer-Encoding: chunked`` only and never with ``Content-Length``,
chunk sizes in hex with bounded extensions and trailers, no header line folding, bounded head size. A fault
raises ``ClientFault`` with the status to answer and the reason counted in the server's stats.

Pure: functions of bytes (and bytearrays they consume from), testable without a socket; its only state is
bounded caches of valid request lines and header lines (they repeat on every request of a client). This
module never reads a socket, never takes a lock, never knows a deadline or a memory budget (the caller's
``admit`` decides whether a chunk may be buffered).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.http.messages import Headers

#: Limits on what a request may send before its body (docs/configuration.md quotes them).
MAX_REQUEST_LINE = 8192
MAX_HEAD = 32 * 1024
MAX_CHUNK_LINE = 1024
MAX_TRAILERS = 8192

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
_HTTP09 = "HTTP/0.9 requests are not supported (send HTTP/1.1)"
_CONTROL = re.compile(rb"[\x00-\x20\x7f]")

_T = TypeVar("_T")
#: Parsed request lines and header field lines by their bytes (valid ones only; see ``_remember``).
_LINE_CACHE: dict[bytes, tuple[str, str, tuple[int, int]]] = {}
_FIELD_CACHE: dict[bytes, tuple[str, str]] = {}
_CACHE_MAX = 1024
_CACHE_LINE_MAX = 256


class ClientFault(Exception):
    """A request refused before any handler runs; answered with ``status`` and closed."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # the label counted in ``HTTPServer.stats``


class Framing(NamedTuple):
    """What the header fields say: the headers, whether the connection stays open, and how the body is
    framed (``chunked``, else ``length`` bytes; 0 when none)."""

    headers: Headers
    keep_alive: bool
    chunked: bool
    length: int
    expect_continue: bool


def skip_blank_lines(buf: bytearray) -> None:
    """Drop empty lines before a request line (RFC 9112 2.2)."""
    while buf[:2] == b"\r\n" or buf[:1] == b"\n":
        del buf[: 2 if buf[:1] == b"\r" else 1]


def take_head(buf: bytearray) -> bytes | None:
    """Cut the request head (request line and header fields, without the empty line that ends them) from
    ``buf``; None while it is incomplete. Refuses a head that can no longer be valid without waiting for
    the rest: a request line over ``MAX_REQUEST_LINE`` (414), HTTP/0.9 (400), a head over ``MAX_HEAD`` (431)."""
    span = head_end(buf, MAX_HEAD + 4)
    if span is None:
        first = buf.find(b"\n", 0, MAX_REQUEST_LINE + 2)
        if first < 0 and len(buf) > MAX_REQUEST_LINE:
            raise ClientFault(414, "request line too long", "too_large")
        if first >= 0 and buf[:first].rstrip(b"\r").count(b" ") == 1:
            # HTTP/0.9 has no headers to wait for: refuse now rather than at the deadline.
            raise ClientFault(400, _HTTP09, "bad_request")
        if len(buf) > MAX_HEAD:
            raise ClientFault(431, "request header fields too large", "too_large")
        return None
    head = bytes(buf[: span[0]])
    del buf[: span[1]]
    return head


def head_end(buf: bytearray, end: int) -> tuple[int, int] | None:
    """Where the first empty line (``\\r?\\n\\r?\\n``) ending within ``buf[:end]`` starts and ends, or None:
    what ``re.search(rb"\\r?\\n\\r?\\n", buf, 0, end)`` finds, by two ``find`` calls (a regex without
    a literal prefix tries every byte: several times slower on a head of a few hundred bytes)."""
    # The first LF followed by an LF or by CRLF; a CR just before it belongs to the match.
    j = buf.find(b"\n\r\n", 0, end)
    k = buf.find(b"\n\n", 0, end if j < 0 else min(end, j + 1))
    if k >= 0:
        j, stop = k, k + 2
    elif j >= 0:
        stop = j + 3
    else:
        return None
    return (j - 1 if j and buf[j - 1] == 13 else j), stop


#: Whole request heads already parsed (a scraper sends the same head on every request of its connection).
_HEAD_CACHE: dict[bytes, tuple[str, str, tuple[int, int], Framing]] = {}
_HEAD_CACHE_MAX = 256
_HEAD_CACHE_BYTES = 2048


def parse_head(head: bytes) -> tuple[str, str, tuple[int, int], Framing]:
    """A request head from ``take_head`` to (method, target, version, ``Framing``); valid heads are remembered
    whole (bounded in entries and size; the ``Headers`` they hold are shared, and only ever read)."""
    out = _HEAD_CACHE.get(head)
    if out is None:
        lines = head.split(b"\n")
        method, target, version = parse_request_line(lines[0].removesuffix(b"\r"))
        out = (method, target, version, parse_fields(lines[1:], version))
        if len(head) <= _HEAD_CACHE_BYTES and not _has_credentials(head):
            remember(_HEAD_CACHE, head, out, _HEAD_CACHE_MAX)
    return out


def parse_request_line(line: bytes) -> tuple[str, str, tuple[int, int]]:
    """``GET /path HTTP/1.1`` (without its line end) to (method, target, version)."""
    out = _LINE_CACHE.get(line)
    if out is None:
        out = _parse_request_line(line)
        _remember(_LINE_CACHE, line, out)
    return out


def _parse_request_line(line: bytes) -> tuple[str, str, tuple[int, int]]:
    if len(line) > MAX_REQUEST_LINE:
        raise ClientFault(414, "request line too long", "too_large")
    parts = line.split(b" ")
    if len(parts) != 3:
        if len(parts) == 2:
            raise ClientFault(400, _HTTP09, "bad_request")
        raise ClientFault(400, "malformed request line", "bad_request")
    method, target, version = parts
    vm = _VERSION.fullmatch(version)
    if vm is None:
        raise ClientFault(400, "malformed HTTP version in the request line", "bad_request")
    if (vm.group(1), vm.group(2)) not in ((b"1", b"0"), (b"1", b"1")):
        raise ClientFault(505, "only HTTP/1.0 and HTTP/1.1 are supported", "bad_request")
    if not _TOKEN.fullmatch(method):
        raise ClientFault(400, "malformed method in the request line", "bad_request")
    if not target or _CONTROL.search(target):
        raise ClientFault(400, "malformed request target", "bad_request")
    return method.decode("ascii"), target.decode("latin-1"), (1, int(vm.group(2)))


def parse_fields(lines: list[bytes], version: tuple[int, int]) -> Framing:
    """The header field lines of a request (line ends ``\\n`` already split off) to its ``Framing``."""
    items: list[tuple[str, str]] = []
    cache = _FIELD_CACHE
    for raw in lines:
        item = cache.get(raw)
        if item is None:
            item = _parse_field(raw)
            _remember(cache, raw, item)
        items.append(item)
    headers = Headers(items)
    tokens = headers.get_all("Connection")
    if tokens:
        connection = {t.strip().lower() for t in ",".join(tokens).split(",")}
        keep_alive = "close" not in connection if version == (1, 1) else "keep-alive" in connection
    else:
        keep_alive = version == (1, 1)
    te = headers.get_all("Transfer-Encoding")
    cl = headers.get_all("Content-Length")
    chunked, length = False, 0
    if te:
        if cl:
            raise ClientFault(400, "both Transfer-Encoding and Content-Length are set", "bad_request")
        if len(te) > 1 or te[0].strip().lower() != "chunked":
            raise ClientFault(501, f"Transfer-Encoding {', '.join(te)!r} is not supported "
                                   "(use chunked or Content-Length)", "bad_request")
        if version == (1, 0):
            raise ClientFault(400, "chunked Transfer-Encoding needs HTTP/1.1", "bad_request")
        chunked = True
    elif cl:
        if len(cl) > 1:
            raise ClientFault(400, "more than one Content-Length header", "bad_request")
        raw_cl = cl[0].encode("latin-1")
        if not _DIGITS.fullmatch(raw_cl):
            raise ClientFault(400, f"invalid Content-Length {cl[0]!r} (ASCII digits only)", "bad_request")
        length = int(raw_cl)
    expect_continue = version == (1, 1) and headers.get("Expect", "").strip().lower() == "100-continue"
    return Framing(headers, keep_alive, chunked, length, expect_continue)


def _parse_field(raw: bytes) -> tuple[str, str]:
    """One header field line (its ``\\n`` split off) to (name, value)."""
    raw = raw.removesuffix(b"\r")
    if raw[:1] in (b" ", b"\t"):
        raise ClientFault(400, "obsolete header line folding is not supported", "bad_request")
    name, sep, value = raw.partition(b":")
    if not sep or not _TOKEN.fullmatch(name):
        raise ClientFault(400, "malformed header line", "bad_request")
    return name.decode("ascii"), value.strip(b" \t").decode("latin-1")


def _remember(cache: dict[bytes, _T], line: bytes, value: _T) -> None:
    """Keep a valid line's parse (a client repeats its request line and most header lines on every request);
    bounded in entries and line length."""
    if len(line) <= _CACHE_LINE_MAX and not _has_credentials(line):
        remember(cache, line, value, _CACHE_MAX)


def _has_credentials(raw: bytes) -> bool:
    """A head or line that carries a password or token (``Authorization``, ``Proxy-Authorization``) is never
    kept by the parse caches: credentials stay in memory no longer than their request."""
    return b"authorization" in raw.lower()


def split_target(target: str) -> tuple[str, str]:
    """A request target to (path, query without ``?`` and fragment); the absolute form (RFC 9112 3.2.2)
    gives its path."""
    path, _, query = target.partition("?")
    if path.startswith(("http://", "https://")):
        path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
    return path, query.partition("#")[0]


class ChunkedReader:
    """Decodes a chunked body as its bytes arrive: ``read`` moves what a buffer holds into the body and
    keeps its place in the framing between calls."""

    __slots__ = ("_state", "_left", "_trailer_bytes")

    def __init__(self) -> None:
        self._state = "size"
        self._left = 0
        self._trailer_bytes = 0

    def read(self, buf: bytearray, body: bytearray, admit: Callable[[int], bool]) -> bool:
        """Consume ``buf`` into ``body``; True once the body and its trailers are in, or once ``admit``
        (asked with each chunk's size before it is buffered) refuses a chunk. Trailers are ignored."""
        while True:
            if self._state == "size":
                nl = buf.find(b"\n", 0, MAX_CHUNK_LINE)
                if nl < 0:
                    if len(buf) >= MAX_CHUNK_LINE:
                        raise ClientFault(400, "chunk size line too long", "bad_request")
                    return False
                line = bytes(buf[:nl]).removesuffix(b"\r")
                del buf[: nl + 1]
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size_text):
                    raise ClientFault(400, "malformed chunk size in chunked body (hex digits only)", "bad_request")
                size = int(size_text, 16)
                if size == 0:
                    self._state = "trailer"
                    continue
                if not admit(size):
                    return True
                self._left = size
                self._state = "data"
            elif self._state == "data":
                take = buf[: self._left]
                body += take
                del buf[: len(take)]
                self._left -= len(take)
                if self._left:
                    return False
                self._state = "crlf"
            elif self._state == "crlf":
                if len(buf) < 2 and buf[:1] != b"\n":
                    return False
                if buf[:2] == b"\r\n":
                    del buf[:2]
                elif buf[:1] == b"\n":
                    del buf[:1]
                else:
                    raise ClientFault(400, "chunk data not followed by CRLF", "bad_request")
                self._state = "size"
            else:  # trailer section: bounded, ignored
                nl = buf.find(b"\n")
                if nl < 0:
                    if self._trailer_bytes + len(buf) > MAX_TRAILERS:
                        raise ClientFault(431, "chunked trailer section too large", "too_large")
                    return False
                self._trailer_bytes += nl + 1
                if self._trailer_bytes > MAX_TRAILERS:
                    raise ClientFault(431, "chunked trailer section too large", "too_large")
                line = bytes(buf[:nl]).removesuffix(b"\r")
                del buf[: nl + 1]
                if not line:
                    return True
