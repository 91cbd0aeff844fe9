"""What a handler sees and returns: ``Request``, ``Response``, ``HTTPError``, ``Headers``, and the bytes a
``Response`` becomes on the wire (``serialise``).

A handler takes a ``Request`` (method, path without the query string, raw query, case-insensitive
headers, client address, and the body already received in full through ``read_body``) and returns a
``Response`` (status, body bytes or a tuple of parts written one after another, headers; ``Content-Length``
is added). It may raise ``HTTPError`` for a plain-text error.

Pure data and formatting: this module never touches a socket, a thread or a lock (the Date header's
once-a-second cache is a plain tuple swap).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from types import MappingProxyType
from typing import Any

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.http.codec import GZIP, BodyTooLarge, MalformedBody, TruncatedBody, inflate

PROJECT_NAME = "gpu-energy-exporter"
_TEXT = "text/plain; charset=utf-8"

Handler = Callable[["Request"], "Response"]
Routes = Mapping[tuple[str, str], Handler]


class HTTPError(Exception):
    """Raised by handlers (and ``Request.read_body``) to answer with a plain-text error."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})


@dataclass(frozen=True)
class Response:
    status: int
    #: the body, or its parts in order (written without being joined: see ``serialise``)
    body: bytes | tuple[bytes, ...] = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str, headers: Mapping[str, str] | None = None) -> Response:
        return cls(status, text.encode("utf-8"), {"Content-Type": _TEXT, **(headers or {})})


class Headers:
    """Request headers in arrival order; ``get`` and ``in`` ignore case."""

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items
        self._index: dict[str, list[str]] = {}
        for k, v in items:
            self._index.setdefault(k.lower(), []).append(v)

    def get(self, name: str, default: Any = None) -> Any:
        values = self._index.get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str) -> list[str]:
        return list(self._index.get(name.lower(), []))

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._index

    def __getitem__(self, name: str) -> str | None:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)


class Request:
    """One request as a handler sees it.

    ``method`` and ``path`` (without the query string), ``query`` (raw, without ``?``), ``headers``
    (case-insensitive ``.get``), ``client_address``; the body, already received in full, through
    ``read_body``. ``connection``: what the server knows of the connection (``connection.ConnectionInfo``:
    peer and local address, a Unix-domain peer's credentials, a cached identity), None when made elsewhere.
    """

    def __init__(
        self, method: str, path: str, query: str, headers: Headers, client_address: tuple[Any, ...],
        body: bytes = b"",
        *,
        refused_length: int = 0,
        limit: int = 0,
        connection: Any = None,
    ) -> None:
        self.connection = connection
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.client_address = client_address
        self._body = body
        self._refused_length = refused_length
        self._limit = limit

    @property
    def body_length(self) -> int:
        """Bytes of the body as received (before any decoding)."""
        return len(self._body)

    def read_body(self, max_bytes: int, *, decode: bool = True) -> bytes:
        """The request body, at most ``max_bytes`` both as sent and after decoding.

        Raises ``HTTPError`` 413 when larger, 400 on a damaged gzip stream, 415 on a ``Content-Encoding``
        other than gzip/identity (with ``decode=True``). Bodies over the server's ``max_body_bytes`` were
        already refused with 413 before the handler ran.
        """
        if self._refused_length:
            limit = min(max_bytes, self._limit) if self._limit else max_bytes
            raise HTTPError(413, f"request body of {self._refused_length} bytes is larger than {limit} bytes")
        if len(self._body) > max_bytes:
            raise HTTPError(413, f"request body of {len(self._body)} bytes is larger than {max_bytes} bytes")
        if not decode:
            return self._body
        return decode_body(self._body, self.headers.get("Content-Encoding"), max_bytes)



def decode_body(data: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """Undo a gzip ``Content-Encoding`` within ``max_bytes`` (several members allowed)."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return data
    if enc not in ("gzip", "x-gzip"):
        raise HTTPError(415, f"Content-Encoding {encoding!r} is not supported (use gzip or none)")
    try:
        return inflate(data, max_bytes, GZIP)
    except MalformedBody as exc:
        raise HTTPError(400, f"malformed gzip body: {exc}") from None
    except BodyTooLarge:
        raise HTTPError(413, f"request body is larger than {max_bytes} bytes once decompressed") from None
    except TruncatedBody:
        raise HTTPError(400, "truncated gzip body") from None


# ----------------------------------------------------------------------------------------------------
# a response on the wire


def serialise(response: Response, extra_headers: tuple[tuple[str, str], ...], *, close: bool,
              head: bool) -> bytes | list[bytes]:
    """The status line, headers (``Server``, ``Date``, the response's, then ``extra_headers`` it does not
    set, ``Content-Length``, ``Connection: close`` when ``close``) and, unless ``head``, the body.

    A response whose headers are read-only (a ``MappingProxyType``: a constant answer, such as the OTLP
    receiver's full success) is encoded once and its bytes reused while the ``Date`` line stays the same.
    A body in parts gives a list: the head, then the parts (for the connection to write without joining)."""
    global _memo
    date = _date_line()
    if type(response.body) is tuple:
        return _serialise_parts(response, response.body, extra_headers, date, close, head)
    memo = _memo
    if memo is not None and memo[0] is response and memo[1] is extra_headers and memo[2] is date \
            and memo[3] == (close, head):
        return memo[4]
    out = _serialise(response, extra_headers, date, close, head)
    if type(response.headers) is MappingProxyType:
        _memo = (response, extra_headers, date, (close, head), out)
    return out


#: (status, id of read-only headers, extra headers, Date line) -> (those headers, the head up to
#: ``Content-Length``, or None where it cannot be reused): the telemetry path's answers differ only in their
#: length within a second. The entry holds the headers, so their id is not reused while it is there.
_prefixes: dict[tuple[int, int, tuple[tuple[str, str], ...], str], tuple[Mapping[str, str], bytes | None]] = {}


def _serialise_parts(response: Response, parts: tuple[bytes, ...], extra_headers: tuple[tuple[str, str], ...],
                     date: str, close: bool, head: bool) -> bytes | list[bytes]:
    headers = response.headers
    prefix = None
    if type(headers) is MappingProxyType:
        key = (response.status, id(headers), extra_headers, date)
        entry = _prefixes.get(key)
        if entry is None or entry[0] is not headers:
            text, sent = _head_lines(response, extra_headers, date)
            plain = "content-length" not in sent and 200 <= response.status and response.status not in (204, 304)
            # emptied at 16 entries: by then a new second (or content type) has made the old lines useless
            entry = remember(_prefixes, key, (headers, text.encode("latin-1") if plain else None), 16)
        prefix = entry[1]
    if prefix is None:  # the general path, on the joined body
        return _serialise(Response(response.status, b"".join(parts), headers), extra_headers, date, close, head)
    length = sum(map(len, parts))
    out = prefix + (f"Content-Length: {length}\r\nConnection: close\r\n\r\n" if close
                    else f"Content-Length: {length}\r\n\r\n").encode("ascii")
    return out if head else [out, *parts]


def _head_lines(response: Response, extra_headers: tuple[tuple[str, str], ...], date: str) -> tuple[str, set[str]]:
    """The head's lines before ``Content-Length``, each ended by CRLF, and the header names set (lower case)."""
    lines = [_status_line(response.status), _SERVER_LINE, date]
    sent = set()
    for k, v in response.headers.items():
        lines.append(f"{k}: {v}")
        sent.add(k.lower())
    for k, v in extra_headers:
        if k.lower() not in sent:
            lines.append(f"{k}: {v}")
    return "\r\n".join(lines) + "\r\n", sent


def _serialise(response: Response, extra_headers: tuple[tuple[str, str], ...], date: str, close: bool,
               head: bool) -> bytes:
    body = response.body
    assert isinstance(body, bytes)
    text, sent = _head_lines(response, extra_headers, date)
    no_body = response.status in (204, 304) or response.status < 200
    if not no_body and "content-length" not in sent:
        text += f"Content-Length: {len(body)}\r\n"
    if close:
        text += "Connection: close\r\n"
    out = (text + "\r\n").encode("latin-1")
    if not head and not no_body:
        out += body
    return out


_SERVER_LINE = f"Server: {PROJECT_NAME}/{__version__}"
_STATUS_LINES: dict[int, str] = {}
_date_cache: tuple[int, str] = (-1, "")
#: The last read-only response encoded: (response, extra headers, Date line, (close, head), bytes).
_memo: tuple[Response, tuple[tuple[str, str], ...], str, tuple[bool, bool], bytes] | None = None


def _status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        line = f"HTTP/1.1 {status} {reason}"
        if len(_STATUS_LINES) < 1000:
            _STATUS_LINES[status] = line
    return line


def _date_line() -> str:
    """The Date header, formatted once a second."""
    global _date_cache
    now = int(time.time())
    cached = _date_cache
    if cached[0] != now:
        cached = _date_cache = (now, "Date: " + http_date(now))
    return cached[1]


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(t: float) -> str:
    """``email.utils.formatdate(t, usegmt=True)`` (RFC 9110's IMF-fixdate) without importing the ``email``
    package, whatever the locale."""
    g = time.gmtime(t)
    return (f"{_DAYS[g.tm_wday]}, {g.tm_mday:02d} {_MONTHS[g.tm_mon - 1]} {g.tm_year:04d} "
            f"{g.tm_hour:02d}:{g.tm_min:02d}:{g.tm_sec:02d} GMT")
