"""The HTTP layer's pure parts with plain bytes: request framing (``http.parsing``), the size-limited
decoder (``http.codec``) and a response's bytes (``http.messages.serialise``). No socket, no thread."""

from __future__ import annotations

import gzip
import itertools
import random
import re
import zlib

import pytest

from gpu_energy_exporter.http.codec import GZIP, RAW_DEFLATE, ZLIB, BodyTooLarge, MalformedBody, TruncatedBody, inflate
from gpu_energy_exporter.http.messages import HTTPError, Response, decode_body, serialise
from gpu_energy_exporter.http.parsing import (
    MAX_HEAD,
    MAX_REQUEST_LINE,
    MAX_TRAILERS,
    ChunkedReader,
    ClientFault,
    head_end,
    parse_fields,
    parse_request_line,
    skip_blank_lines,
    split_target,
    take_head,
)


def _fault(fn: object, *args: object) -> ClientFault:
    with pytest.raises(ClientFault) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


def test_request_line() -> None:
    assert parse_request_line(b"GET /metrics?x=1 HTTP/1.1") == ("GET", "/metrics?x=1", (1, 1))
    assert parse_request_line(b"POST /v1/metrics HTTP/1.0") == ("POST", "/v1/metrics", (1, 0))
    assert _fault(parse_request_line, b"GET /").status == 400  # HTTP/0.9
    assert _fault(parse_request_line, b"GET / HTTP/2.0").status == 505
    assert _fault(parse_request_line, b"GET / HTTP/1.1 x").message == "malformed request line"
    assert _fault(parse_request_line, b"G(T / HTTP/1.1").message == "malformed method in the request line"
    assert _fault(parse_request_line, b"GET /\x7f HTTP/1.1").message == "malformed request target"
    long = _fault(parse_request_line, b"GET /" + b"a" * MAX_REQUEST_LINE + b" HTTP/1.1")
    assert (long.status, long.reason) == (414, "too_large")


def test_fields_give_the_framing() -> None:
    f = parse_fields([b"Host: x\r", b"Content-Length: 12", b"Expect: 100-continue"], (1, 1))
    assert (f.length, f.chunked, f.keep_alive, f.expect_continue) == (12, False, True, True)
    assert f.headers.get("host") == "x"
    f = parse_fields([b"Transfer-Encoding: chunked", b"Connection: close"], (1, 1))
    assert (f.length, f.chunked, f.keep_alive) == (0, True, False)
    # HTTP/1.0 closes unless asked otherwise, and never expects 100-continue.
    f = parse_fields([b"Expect: 100-continue"], (1, 0))
    assert (f.keep_alive, f.expect_continue) == (False, False)
    assert parse_fields([b"Connection: keep-alive"], (1, 0)).keep_alive


@pytest.mark.parametrize(("lines", "status", "message"), [
    ([b"Content-Length: 1", b"Transfer-Encoding: chunked"], 400, "both Transfer-Encoding and Content-Length"),
    ([b"Transfer-Encoding: gzip"], 501, "is not supported"),
    ([b"Content-Length: 1", b"Content-Length: 1"], 400, "more than one Content-Length"),
    ([b"Content-Length: +1"], 400, "ASCII digits only"),
    ([b"Host: x", b" folded"], 400, "folding"),
    ([b"Bad Name: x"], 400, "malformed header line"),
])
def test_fields_refuse_ambiguous_framing(lines: list[bytes], status: int, message: str) -> None:
    fault = _fault(parse_fields, lines, (1, 1))
    assert fault.status == status and message in fault.message


def test_head_is_cut_when_complete_and_refused_early_when_it_cannot_be_valid() -> None:
    buf = bytearray(b"\r\n\nGET / HTTP/1.1\r\nHost: x\r\n\r\nBODY")
    skip_blank_lines(buf)
    assert take_head(buf) == b"GET / HTTP/1.1\r\nHost: x"
    assert buf == bytearray(b"BODY")
    assert take_head(bytearray(b"GET / HTTP/1.1\r\nHost:")) is None
    assert _fault(take_head, bytearray(b"GET /\r\n")).status == 400  # HTTP/0.9: no headers to wait for
    assert _fault(take_head, bytearray(b"G" * (MAX_REQUEST_LINE + 1))).status == 414
    assert _fault(take_head, bytearray(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEAD // 6))).status == 431


def test_head_end_finds_what_the_regex_finds() -> None:
    """``head_end`` (two ``find`` calls) against the regular expression it replaces: every string of CR, LF
    and one other byte up to 7 long, and random ones, at several end bounds."""
    regex = re.compile(rb"\r?\n\r?\n")
    cases = [bytes(t) for n in range(8) for t in itertools.product(b"\r\nx", repeat=n)]
    rng = random.Random(15)
    cases += [bytes(rng.choice(b"\r\nab") for _ in range(rng.randrange(1, 40))) for _ in range(3000)]
    for data in cases:
        buf = bytearray(data)
        for end in range(len(data) + 2):
            m = regex.search(buf, 0, end)
            assert head_end(buf, end) == (None if m is None else m.span()), (data, end)


def test_split_target() -> None:
    assert split_target("/metrics?name[]=a#frag") == ("/metrics", "name[]=a")
    assert split_target("http://host:9863/-/ready?x") == ("/-/ready", "x")
    assert split_target("http://host") == ("/", "")


def test_chunked_body_in_pieces_with_extensions_and_trailers() -> None:
    wire = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\nNEXT"
    reader, body, buf, sizes = ChunkedReader(), bytearray(), bytearray(), []
    done = False
    for i in range(len(wire)):  # one byte at a time, as a trickling client sends it
        buf += wire[i:i + 1]
        done = reader.read(buf, body, lambda n: sizes.append(n) is None)
        if done:
            break
    assert done and body == bytearray(b"hello world") and sizes == [5, 6] and i == len(wire) - 5
    # All at once: the reader stops at the end of the body, leaving a pipelined request in the buffer.
    body, buf = bytearray(), bytearray(wire)
    assert ChunkedReader().read(buf, body, lambda n: True) and body == bytearray(b"hello world")
    assert buf == bytearray(b"NEXT")


def test_chunked_refusal_and_faults() -> None:
    body = bytearray()
    assert ChunkedReader().read(bytearray(b"10\r\n" + b"x" * 16), body, lambda n: False)
    assert body == bytearray()  # a refused chunk is not buffered
    assert _fault(ChunkedReader().read, bytearray(b"-1\r\n"), bytearray(), lambda n: True).status == 400
    assert _fault(ChunkedReader().read, bytearray(b"1\r\nxyz"), bytearray(), lambda n: True).status == 400
    trailers = bytearray(b"0\r\n" + b"T: y\r\n" * (MAX_TRAILERS // 6 + 1))
    assert _fault(ChunkedReader().read, trailers, bytearray(), lambda n: True).status == 431


def test_inflate_limits_every_framing() -> None:
    data = b"x" * 1000
    two_members = gzip.compress(data[:400]) + gzip.compress(data[400:])
    assert inflate(two_members, 1000, GZIP) == data
    assert inflate(zlib.compress(data) + b"ignored", 1000, ZLIB) == data
    raw = zlib.compressobj(wbits=RAW_DEFLATE)
    assert inflate(raw.compress(data) + raw.flush(), 1000, RAW_DEFLATE) == data
    with pytest.raises(BodyTooLarge):
        inflate(gzip.compress(b"\0" * 10_000_000), 999, GZIP)  # a bomb stops at the limit
    with pytest.raises(TruncatedBody):
        inflate(gzip.compress(data)[:-10], 1000, GZIP)
    with pytest.raises(MalformedBody):
        inflate(b"not gzip at all", 1000, GZIP)


@pytest.mark.parametrize(("body", "encoding", "status", "message"), [
    (b"abc", "br", 415, "Content-Encoding 'br' is not supported (use gzip or none)"),
    (b"\x1f\x8b junk", "gzip", 400, "malformed gzip body: "),
    (gzip.compress(b"a" * 50, mtime=0)[:-4], "gzip", 400, "truncated gzip body"),
    (gzip.compress(b"a" * 100, mtime=0), "x-gzip", 413, "request body is larger than 99 bytes once decompressed"),
])
def test_decode_body_answers(body: bytes, encoding: str, status: int, message: str) -> None:
    with pytest.raises(HTTPError) as info:
        decode_body(body, encoding, 99)
    assert info.value.status == status and info.value.message.startswith(message)
    assert decode_body(b"plain", None, 5) == b"plain"


def test_serialise() -> None:
    out = serialise(Response(200, b"hi", {"X-Content-Type-Options": "nosniff"}),
                    (("x-content-type-options", "other"), ("X-Frame-Options", "deny")), close=True, head=False)
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK" and lines[1].startswith("Server: gpu-energy-exporter/")
    assert lines[3:] == ["X-Content-Type-Options: nosniff", "X-Frame-Options: deny", "Content-Length: 2",
                         "Connection: close"]
    assert body == b"hi"
    no_body = serialise(Response(204, b"ignored"), (), close=False, head=False)
    assert no_body.endswith(b"\r\n\r\n") and b"Content-Length" not in no_body
    assert serialise(Response(200, b"hi"), (), close=False, head=True).endswith(b"Content-Length: 2\r\n\r\n")


def test_a_read_only_response_is_reused_only_while_its_bytes_would_not_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import MappingProxyType

    from gpu_energy_exporter.http import messages

    constant = Response(200, b"", MappingProxyType({"Content-Type": "application/x-protobuf"}))
    extra = (("X-Frame-Options", "deny"),)
    now = [1_700_000_000.0]
    monkeypatch.setattr(messages.time, "time", lambda: now[0])
    first = serialise(constant, extra, close=False, head=False)
    assert first == messages._serialise(constant, extra, messages._date_line(), False, False)
    assert serialise(constant, extra, close=False, head=False) is first
    assert serialise(constant, extra, close=True, head=False).endswith(b"Connection: close\r\n\r\n")
    assert serialise(constant, (), close=False, head=False) == messages._serialise(
        constant, (), messages._date_line(), False, False)
    now[0] += 1.0  # a new Date line
    later = serialise(constant, extra, close=False, head=False)
    assert later != first and b"Date: Tue, 14 Nov 2023 22:13:21 GMT" in later
    mutable = Response(200, b"", {"Content-Type": "application/x-protobuf"})
    assert serialise(mutable, extra, close=False, head=False) == later
    assert serialise(mutable, extra, close=False, head=False) is not serialise(mutable, extra, close=False, head=False)


def test_cached_request_and_header_lines_parse_as_before() -> None:
    for _ in range(2):  # parsed, then from the cache
        assert parse_request_line(b"POST /v1/metrics HTTP/1.1") == ("POST", "/v1/metrics", (1, 1))
        framing = parse_fields([b"Host: x\r", b"Content-Length: 12\r", b"Connection: close\r"], (1, 1))
        assert (framing.headers.items(), framing.keep_alive, framing.length) == (
            [("Host", "x"), ("Content-Length", "12"), ("Connection", "close")], False, 12)
        assert parse_fields([b"Host: x\r"], (1, 0)).keep_alive is False
        assert parse_fields([b"Connection: keep-alive\r"], (1, 0)).keep_alive is True
        for bad in (b"POST /v1/\x7fmetrics HTTP/1.1", b"POST /v1/metrics HTTP/2.0"):
            with pytest.raises(ClientFault):
                parse_request_line(bad)
        with pytest.raises(ClientFault):
            parse_fields([b"Host: x\r", b" folded\r"], (1, 1))


def test_heads_with_credentials_are_parsed_but_never_cached() -> None:
    from gpu_energy_exporter.http import parsing

    secret = b"Authorization: Basic dTpzZWNyZXQtcGFzc3dvcmQ="
    for spelling in (secret, secret.replace(b"Authorization", b"aUtHoRiZaTiOn")):
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + spelling
        method, target, _, framing = parsing.parse_head(head)
        assert (method, target) == ("GET", "/metrics")
        assert framing.headers.get("Authorization") == "Basic dTpzZWNyZXQtcGFzc3dvcmQ="
        cached = [*parsing._HEAD_CACHE, *parsing._FIELD_CACHE, *parsing._LINE_CACHE]
        assert not any(b"dTpzZWNyZXQtcGFzc3dvcmQ=" in raw for raw in cached)
    # what carries no credentials is still remembered
    plain = b"GET /metrics HTTP/1.1\r\nHost: y"
    parsing.parse_head(plain)
    assert plain in parsing._HEAD_CACHE
